"""The engine tests' shared workload: 200 passphrase prompts and HF ``generate``'s greedy output for
each."""

import pytest
from passphrase_prompts import question_prompts

ENGINE_MAX_NEW = 10


@pytest.fixture(scope="session")
def workload(lm):
    """(prompt ids, HF generate's greedy ids) for the 200-prompt passphrase workload the engine
    tests share."""
    from kvlab.engine.models import encode
    from kvlab.engine.reference import hf_generate

    model, tok = lm
    ids = [encode(tok, p) for p in question_prompts()]
    return ids, [hf_generate(model, tok, p, max_new_tokens=ENGINE_MAX_NEW) for p in ids]
