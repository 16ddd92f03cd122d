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
    res = subprocess.run(
        [sys.executable, *args, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=300,
    )
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
    # -S: no site-packages at all (no torch, no kvlab); -I: no PYTHONPATH, no user site, no cwd
    # magic.
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


# The start of a script run on a copy: kvlab itself made unimportable, the copy's folder on the
# path.
WITHOUT_KVLAB = """
        import sys
        class NoKvlab:
            def find_spec(self, name, path=None, target=None):
                if name == 'kvlab' or name.startswith('kvlab.'):
                    raise ImportError('kvlab is not installed here')
        sys.meta_path.insert(0, NoKvlab())
        sys.path.insert(0, '.')
"""


def _copy_as_mykv(tmp_path: Path) -> None:
    """kvlab/cache and kvlab/engine copied into ``tmp_path/mykv`` (a package of their own)."""
    (tmp_path / "mykv").mkdir()
    (tmp_path / "mykv" / "__init__.py").write_text("")
    for layer in ("cache", "engine"):
        shutil.copytree(
            PKG / layer, tmp_path / "mykv" / layer, ignore=shutil.ignore_patterns("__pycache__")
        )


def test_cache_and_engine_copied_together_run_a_random_llama(tmp_path):
    _copy_as_mykv(tmp_path)
    out = _run(
        WITHOUT_KVLAB
        + """
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
        ref = [model.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
               for p in prompts]
        print([o.output_ids for o in outs] == ref, outs[1].num_cached_tokens)
    """,
        cwd=tmp_path,
    )
    assert out.splitlines()[-1] == "True 8", out


def test_cache_and_engine_copied_with_data_beside_them_load_the_bundled_model(tmp_path):
    """The repository's layout copied (mykv/cache, mykv/engine, data/): the bundled model is found,
    not kvlab's."""
    _copy_as_mykv(tmp_path)
    shutil.copytree(
        PKG.parent / "data",
        tmp_path / "data",
        ignore=shutil.ignore_patterns("__pycache__", "checkpoints"),
    )
    out = _run(WITHOUT_KVLAB + """
        from mykv.engine import load_model
        from mykv.engine.models import BUNDLED_MODEL
        model, tok = load_model(None, device="cpu")
        print(BUNDLED_MODEL.resolve(), type(model).__name__)
    """, cwd=tmp_path)
    assert (
        out.splitlines()[-1]
        == f"{(tmp_path / 'data' / 'models' / 'kvlab-passphrase-qwen2').resolve()} Qwen2ForCausalLM"
    ), out


def test_public_api_resolves():
    for name in kvlab.__all__:
        assert getattr(kvlab, name) is not None


# --- import graph: AST, every ``import`` in a kvlab module, also inside functions -----------------
def _modules() -> dict[str, Path]:
    """kvlab's modules by dotted name (a package by its ``__init__``)."""
    out = {}
    for f in PKG.rglob("*.py"):
        parts = list(f.relative_to(PKG.parent).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def _imports_of(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """The kvlab modules ``name`` imports: at module level or in a function (both run), not under
    TYPE_CHECKING."""
    import ast

    tree = ast.parse(path.read_text())
    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
    typing_only = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for stmt in node.body
        for n in ast.walk(stmt)
    }
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            targets = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names
            ]
        else:
            continue
        for t in targets:
            while t and t not in mods:  # a name imported from a module: the module
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_the_cycle_finder_finds_a_circle_through_a_function_level_import():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_among_kvlab_modules():
    mods = _modules()
    graph = {name: _imports_of(name, path, mods) for name, path in mods.items()}
    assert "kvlab.cluster.cost" in graph["kvlab.cluster.driver"]  # the graph sees relative imports
    assert _cycles(graph) == []


def _back_arrows(graph: dict[str, set[str]]) -> list[str]:
    """Edges from a library module into the lesson layer: ``kvlab.lessons`` and ``kvlab.built`` (the
    modules generated from the notebooks' export cells are lesson code too)."""
    def lesson(m: str) -> bool:
        return m in ("kvlab.lessons", "kvlab.built") or m.startswith(
            ("kvlab.lessons.", "kvlab.built.")
        )

    return sorted(
        f"{a} -> {b}" for a, deps in graph.items() if not lesson(a) for b in deps if lesson(b)
    )


def test_the_back_arrow_finder_finds_a_library_module_importing_a_lesson():
    graph = {
        "kvlab.blend": {"kvlab.lessons.rope", "kvlab.engine.rope"},
        "kvlab.lessons.rope": {"kvlab.engine.rope"},
        "kvlab.lessons": set(),
        "kvlab.engine.rope": set(),
        "kvlab.lessons_extra": {"kvlab.lessons"},
        "kvlab.cluster.x": {"kvlab.built.nb09"},
        "kvlab.built.nb09": {"kvlab.lessons.common", "kvlab.cluster.x"},
    }
    assert _back_arrows(graph) == [
        "kvlab.blend -> kvlab.lessons.rope",
        "kvlab.cluster.x -> kvlab.built.nb09",
        "kvlab.lessons_extra -> kvlab.lessons",
    ]


def test_no_library_module_imports_lesson_code():
    """No back-arrow: the library (kvlab minus kvlab/lessons) never imports kvlab.lessons, also not
    in a function."""
    mods = _modules()
    graph = {name: _imports_of(name, path, mods) for name, path in mods.items()}
    # the graph sees the lessons' imports of the engine
    assert "kvlab.engine.models" in graph["kvlab.lessons.common"]
    assert _back_arrows(graph) == []


def test_the_engine_reads_only_what_the_cache_protocol_declares():
    """Every ``block_manager.X`` (or ``bm.X``) the engine and scheduler read is a ``CacheManager``
    member, and every ``block_manager.seqs[...].Y`` a ``CacheSeq`` member (``offload`` is left out:
    it requires a ``BlockManager``)."""
    import ast

    from kvlab.cache.interface import CACHE_MEMBERS, CacheSeq

    def is_cache(node: ast.AST) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr == "block_manager") or (
            isinstance(node, ast.Name) and node.id == "bm")

    read, of_seqs = set(), set()
    for name in ("engine.py", "scheduler.py"):
        for node in ast.walk(ast.parse((PKG / "engine" / name).read_text())):
            if isinstance(node, ast.Attribute) and is_cache(node.value):
                read.add(node.attr)
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Subscript)
                and isinstance(node.value.value, ast.Attribute)
                and node.value.value.attr == "seqs"
                and is_cache(node.value.value.value)
            ):
                of_seqs.add(node.attr)
    # the scan sees them; the step reads no sequence entry (num_allocated_tokens,
    # num_restored_tokens: issue 51)
    assert {"allocate", "block_table", "num_allocated_tokens", "num_restored_tokens"} <= read
    assert "seqs" not in read and of_seqs == set()
    assert read - set(CACHE_MEMBERS) == set()
    assert of_seqs - set(CacheSeq.__annotations__) == set()


def _unexplained_broad_excepts(source: str) -> list[int]:
    """Lines of ``except``, ``except Exception`` or ``except BaseException`` handlers that neither
    end in ``raise`` nor carry a comment (on the ``except`` line or on the comment lines right above
    it)."""
    import ast

    lines = source.splitlines()
    out = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ExceptHandler):
            continue
        types = node.type.elts if isinstance(node.type, ast.Tuple) else [node.type]
        if not any(
            t is None or (isinstance(t, ast.Name) and t.id in ("Exception", "BaseException"))
            for t in types
        ):
            continue
        if isinstance(node.body[-1], ast.Raise):
            continue
        i = node.lineno - 1
        commented = "#" in lines[i]
        while not commented and i > 0 and lines[i - 1].strip().startswith("#"):
            commented, i = True, i - 1
        if not commented:
            out.append(node.lineno)
    return out


def test_the_broad_except_finder():
    code = textwrap.dedent("""
        try:
            pass
        except Exception:
            pass
        try:
            pass
        except (ValueError, BaseException) as e:
            raise RuntimeError() from e
        try:
            pass
        # why it is broad
        except Exception:
            pass
        try:
            pass
        except:  # why
            pass
        try:
            pass
        except BaseException:
            cleanup = 1
            raise
        try:
            pass
        except ValueError:
            pass
        try:
            pass
        except:
            pass
    """)
    assert _unexplained_broad_excepts(code) == [4, 30]


def test_every_broad_except_in_engine_and_cache_re_raises_or_says_why():
    """Issue 37: a broad ``except`` in kvlab/engine or kvlab/cache re-raises, or a comment names why
    it is broad."""
    found = {
        f"{path.relative_to(PKG.parent)}:{line}"
        for layer in ("engine", "cache")
        for path in sorted((PKG / layer).glob("*.py"))
        for line in _unexplained_broad_excepts(path.read_text())
    }
    assert found == set()


def test_no_kvlab_module_assigns_into_a_third_party_module():
    """No monkeypatching: nothing of the form ``<name imported from a third-party package>.attr... =
    value``."""
    import ast

    def third(module: str) -> bool:
        return module.split(".")[0] not in sys.stdlib_module_names and not module.startswith(
            "kvlab"
        )

    offenders = []
    for path in PKG.rglob("*.py"):
        tree = ast.parse(path.read_text())
        third_party = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                third_party |= {
                    (a.asname or a.name).split(".")[0] for a in node.names if third(a.name)
                }
            elif isinstance(node, ast.ImportFrom) and not node.level and third(node.module or ""):
                third_party |= {a.asname or a.name for a in node.names}
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, (ast.AugAssign, ast.AnnAssign)) else []
            for t in targets:
                root = t
                while isinstance(root, ast.Attribute):
                    root = root.value
                if (
                    isinstance(t, ast.Attribute)
                    and isinstance(root, ast.Name)
                    and root.id in third_party
                ):
                    offenders.append(
                        f"{path.relative_to(PKG.parent)}:{node.lineno}: {ast.unparse(t)}"
                    )
    assert offenders == []


# --- cache/ + engine/ with their tests, lifted out under another package name ---------------------
# Not yet portable, each for a reason outside this test (kept out of the copy's runs below):
COPY_LEFT_OUT = {
    "tests/engine/test_scheduler.py::test_sampling_params_keeps_its_import_paths": (
        "checks the top-level kvlab name"
    ),
}
ENGINE_SUBSET = [
    "tests/engine/test_scheduler.py",
    "tests/engine/test_kv_store.py",
    "tests/engine/test_sampling.py",
    "tests/engine/test_offload.py",  # this one and the next on the bundled model
    "tests/engine/test_engine.py::test_salt_reaches_the_block_manager",
]


def _copy_as(tmp: Path, name: str) -> Path:
    """kvlab/cache, kvlab/engine, tests/conftest.py, tests/cache, tests/engine under ``tmp``;
    ``kvlab.`` -> ``name.``."""
    import re

    tests = Path(__file__).resolve().parent
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    (tmp / name).mkdir()
    (tmp / name / "__init__.py").write_text("")
    for layer in ("cache", "engine"):
        shutil.copytree(PKG / layer, tmp / name / layer, ignore=skip)
        shutil.copytree(tests / layer, tmp / "tests" / layer, ignore=skip)
    shutil.copy(tests / "conftest.py", tmp / "tests" / "conftest.py")
    for path in tmp.rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        path.write_text(re.sub(r"\bkvlab\.(cache|engine)\b", rf"{name}.\1", text), encoding="utf-8")
    return tmp


def _pytest_without_kvlab(cwd: Path, args: list[str], env: dict | None = None) -> tuple[int, str]:
    """Run pytest in ``cwd`` with ``kvlab`` unimportable; the output ends with the modules the run
    loaded."""
    import os

    code = textwrap.dedent("""
        import sys
        class NoKvlab:
            def find_spec(self, name, path=None, target=None):
                if name == 'kvlab' or name.startswith('kvlab.'):
                    raise ImportError('kvlab is not installed here: ' + name)
        sys.meta_path.insert(0, NoKvlab())
        import pytest
        rc = pytest.main(sys.argv[1:])
        print('LOADED', ' '.join(m for m in ('torch', 'transformers') if m in sys.modules) or '-')
        kvlab_mods = sorted(m for m in sys.modules if m.split('.')[0] == 'kvlab')
        print('KVLAB', ' '.join(kvlab_mods) or '-')
        sys.exit(rc)
    """)
    res = subprocess.run(
        [sys.executable, "-c", code, "-q", "-p", "no:cacheprovider", "--rootdir", str(cwd), *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=900,
        env={**os.environ, **(env or {})},
    )
    return res.returncode, res.stdout + res.stderr


def test_cache_tests_run_on_a_copy_under_another_name_without_torch(tmp_path):
    """tests/cache passes on a copy of kvlab/cache named ``kvcopy``, with kvlab unimportable and
    torch never loaded."""
    root = _copy_as(tmp_path, "kvcopy")
    ignore = [f"--ignore={p}" for p in COPY_LEFT_OUT if p.startswith("tests/cache/")]
    rc, out = _pytest_without_kvlab(root, ["tests/cache", *ignore])
    assert rc == 0, out[-4000:]
    assert "passed" in out and "LOADED -" in out and "KVLAB -" in out, out[-2000:]


def test_engine_tests_run_on_a_copy_under_another_name(tmp_path):
    """A fast part of tests/engine passes on the copy; the bundled model comes through
    ``KVLAB_TEST_MODEL``."""
    from kvlab.engine.models import BUNDLED_MODEL

    root = _copy_as(tmp_path, "kvcopy")
    deselect = [f"--deselect={p}" for p in COPY_LEFT_OUT if p.startswith("tests/engine/")]
    rc, out = _pytest_without_kvlab(
        root, [*ENGINE_SUBSET, *deselect], env={"KVLAB_TEST_MODEL": str(BUNDLED_MODEL)}
    )
    assert rc == 0, out[-4000:]
    assert "passed" in out and "KVLAB -" in out, out[-2000:]
