"""The package's layers: cache/ copies alone (no torch, no kvlab), engine/ imports no lesson code,
cache/ + engine/ copied together run a random Llama, and ``import kvlab`` stays torch-free."""

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import kvlab

PKG = Path(kvlab.__file__).resolve().parent


def _run(code: str, *args: str, cwd: Path | None = None) -> str:
    res = subprocess.run([sys.executable, *args, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                         cwd=cwd, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout.strip()


def test_import_kvlab_is_torch_free():
    out = _run("""
        import sys, kvlab
        kvlab.BlockManager, kvlab.BlockPool, kvlab.NoFreeBlocksError
        print(','.join(m for m in ('torch', 'transformers', 'numpy') if m in sys.modules))
    """)
    assert out == "", f"`import kvlab` pulled in: {out}"


def test_cache_copied_alone_runs_with_a_bare_python(tmp_path):
    shutil.copytree(PKG / "cache", tmp_path / "mykv", ignore=shutil.ignore_patterns("__pycache__"))
    # -S: no site-packages at all (no torch, no kvlab); -I: no PYTHONPATH, no user site, no cwd magic.
    out = _run("""
        import sys
        sys.path.insert(0, '.')
        from mykv import BlockManager, NoFreeBlocksError
        bm = BlockManager(num_blocks=8, block_size=4)
        a = bm.allocate('a', list(range(10)))
        b = bm.allocate('b', list(range(8)) + [99, 98])
        bm.check_invariants()
        print(a, b, 'kvlab' in sys.modules, 'torch' in sys.modules)
        bm.free('a'); bm.free('b'); bm.check_invariants()
        try:
            bm.allocate('c', list(range(100)))
        except NoFreeBlocksError:
            print('refused')
    """, "-S", "-I", cwd=tmp_path)
    assert out.splitlines() == ["0 8 False False", "refused"], out


def test_engine_imports_no_lesson_code():
    out = _run("""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.startswith(('kvlab.lessons', 'kvlab.prefix', 'kvlab.vllm')):
                    raise ImportError('blocked: ' + name)
        sys.meta_path.insert(0, Block())
        import kvlab.engine
        from kvlab.engine import Engine, SamplingParams, load_model
        print(sorted(m for m in sys.modules if m.startswith('kvlab.')))
    """)
    assert "kvlab.engine.engine" in out and "lessons" not in out and "kvlab.prefix" not in out


def test_cache_and_engine_copied_together_run_a_random_llama(tmp_path):
    (tmp_path / "mykv").mkdir()
    (tmp_path / "mykv" / "__init__.py").write_text("")
    for layer in ("cache", "engine"):
        shutil.copytree(PKG / layer, tmp_path / "mykv" / layer, ignore=shutil.ignore_patterns("__pycache__"))
    out = _run("""
        import sys
        class NoKvlab:
            def find_spec(self, name, path=None, target=None):
                if name == 'kvlab' or name.startswith('kvlab.'):
                    raise ImportError('kvlab is not installed here')
        sys.meta_path.insert(0, NoKvlab())
        sys.path.insert(0, '.')
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM
        from mykv.engine import Engine, SamplingParams
        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
        model = LlamaForCausalLM(cfg).eval()
        prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 5, 6, 7, 8, 10, 11]]
        eng = Engine(model, None, num_blocks=16, block_size=4)
        outs = eng.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))
        ref = [model.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, len(p):].tolist() for p in prompts]
        print([o.output_ids for o in outs] == ref, outs[1].num_cached_tokens)
    """, cwd=tmp_path)
    assert out.splitlines()[-1] == "True 8", out


def test_public_api_resolves():
    for name in kvlab.__all__:
        assert getattr(kvlab, name) is not None
