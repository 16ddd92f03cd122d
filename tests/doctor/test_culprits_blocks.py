"""The cache's rules as culprits (kvlab.doctor.culprits.blocks): prefixes that end inside a block,
tenant salts."""

from kvlab.doctor.culprits.blocks import (
    alignment_boundaries,
    alignment_culprit,
    pad_to_blocks,
    padded,
    public_prefixes,
    tenant_culprit,
)
from kvlab.doctor.replay import replay_tokens
from kvlab.doctor.tokenization import tokstr

PAD = 9


def shared_head(head: int, n: int = 10) -> list[dict]:
    """``n`` token-id requests that share their first ``head`` tokens, then go their own way."""
    return [{"token_ids": list(range(100, 100 + head)) + [1000 + i] * 7} for i in range(n)]


def test_pad_to_blocks_pads_each_boundary_a_prompt_starts_with():
    toks, inserts = pad_to_blocks(
        [tokstr([1, 2, 3, 4, 5, 6, 7]), tokstr([8, 8])], [tokstr([1, 2, 3])], 4, PAD
    )
    assert [list(map(ord, t)) for t in toks] == [[1, 2, 3, PAD, 4, 5, 6, 7], [8, 8]]
    assert inserts == [[(3, 1)], []]


def test_a_shared_prefix_ending_inside_a_block_is_named_and_padded(chat_log):
    prep, div, _ = chat_log(shared_head(10))
    assert alignment_boundaries(prep.tokens, div) == [prep.tokens[0][:10]]
    c = alignment_culprit(prep, div, 4, PAD, "\n")
    assert c.kind == "alignment" and c.position == 10 and c.details["lost_tokens"] == 9 * 2
    before, after = replay_tokens(prep.tokens, 4), replay_tokens(c.token_fix(prep).tokens, 4)
    # 2 tokens padded: 3 whole blocks shared
    assert (before.hit_tokens, after.hit_tokens) == (9 * 8, 9 * 12)
    assert padded(prep, 4, PAD).padded


def test_a_prefix_that_ends_on_a_block_boundary_is_not_named(chat_log):
    prep, div, _ = chat_log(shared_head(8))
    assert alignment_culprit(prep, div, 4, PAD, "\n") is None


def tenant_log(tenants: list[str]) -> list[dict]:
    operator = "Operator rules: be brief, be kind, never invent a policy, cite the documents."
    return [{"messages": [{"role": "system", "content": operator},
                          {"role": "user", "content": f"question {i} from {t}"}], "tenant": t}
            for i, t in enumerate(tenants)]


def test_salts_that_split_a_prefix_every_tenant_sends_are_named(chat_log):
    tenants = ["acme", "globex", "acme", "globex"]
    prep, _, _ = chat_log(tenant_log(tenants))
    # the whole system part: both tenants send it
    assert public_prefixes(prep, tenants) == prep.sys_tokens
    c = tenant_culprit(prep, tenants, "tenant", 16, salted=100, unsalted=300)
    assert c.kind == "tenant-salt" and c.policy == "public-prefix" and c.affected == 4
    assert "salting gives up 200 hit tokens" in c.evidence[0]


def test_salts_that_split_nothing_are_not_named(chat_log):
    tenants = ["acme", "globex"] * 2
    prep, _, _ = chat_log(tenant_log(tenants))
    # salts cost nothing
    assert tenant_culprit(prep, tenants, "tenant", 16, salted=300, unsalted=300) is None
    one = ["acme"] * 4
    assert (
        tenant_culprit(chat_log(tenant_log(one))[0], one, "tenant", 16, salted=100, unsalted=300)
        is None
    )
