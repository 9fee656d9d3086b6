"""Build real engine payload fixtures under ``tests/fixtures/engines/`` from the engines' own serialization code.

For every engine version a fixture needs, this script ``pip download --no-deps``-s the published wheel into a cache
(``/tmp/engine-wheels`` by default), opens it with :mod:`zipfile` and reads only the Python files it needs. It never
imports the engine (that needs torch/CUDA): it takes single functions, methods or ``if`` blocks out of the source text
with :mod:`ast` and runs them in a small namespace (numpy, io, base64 in place of pybase64, which produces identical
bytes), and for field names and shaping rules that live inside large methods it asserts that the exact source line
occurs in that version's file and records its line number. Each fixture directory gets:

* the payload as the engine emits it (``response.json``, ``responses.json``, ``stream.jsonl``, ``*.npz``) and, where
  the request matters, ``request.json``;
* ``expected.npz``: per sample ``<i>_expert_ids`` (int64 ``[n_tokens, num_moe_layers, K]``, logical IDs on the
  MoE-only axis, zeros where not valid), ``<i>_valid`` (bool ``[n_tokens]``: rows the engine computed and returned),
  ``<i>_token_ids`` (int64) and ``sample_ids`` (unicode array);
* ``model_spec.json`` (routelog ``ModelSpec`` JSON), ``SOURCE.json`` (engine, version, wheel, sha256 of each source
  file used, the names taken from it, the lines asserted, a description) and ``notes.json`` where a sample needs one.

``FACTS.md`` (all verified facts with file and line) is rewritten when every fixture is built.

It needs network access to PyPI (wheels of several hundred MB each, downloaded once into the cache), so it is a
maintenance tool, not part of the test suite::

    python tools/make_engine_fixtures.py --out tests/fixtures/engines [--only NAME] [--cache DIR]

No engine source is written to the output; only the fixture files above.
"""

from __future__ import annotations
import __future__

import argparse
import ast
import base64
import contextlib
import hashlib
import io
import json
import shutil
import subprocess
import sys
import textwrap
import types
import zipfile
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "tests" / "fixtures" / "engines"
DEFAULT_CACHE = Path("/tmp/engine-wheels")
IntArray = npt.NDArray[np.int64]


# -- model specs --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Spec:
    """The tiny model a fixture was produced for (routelog ``ModelSpec`` fields plus the HF config it mimics)."""

    name: str
    num_layers: int
    moe_layers: tuple[int, ...]
    num_experts: int
    topk: int
    hf_config: dict[str, Any]

    @property
    def n_moe(self) -> int:
        return len(self.moe_layers)

    def model_spec_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "num_layers": self.num_layers,
            "moe_layers": list(self.moe_layers),
            "num_experts": self.num_experts,
            "topk": self.topk,
        }


DEEPSEEK = Spec(
    "tiny-deepseek-v3",
    6,
    (2, 3, 4, 5),
    64,
    4,
    {
        "model_type": "deepseek_v3",
        "num_hidden_layers": 6,
        "first_k_dense_replace": 2,
        "moe_layer_freq": 1,
        "n_routed_experts": 64,
        "num_experts_per_tok": 4,
    },
)
QWEN = Spec(
    "tiny-qwen3-moe",
    4,
    (0, 1, 2, 3),
    32,
    4,
    {"model_type": "qwen3_moe", "num_hidden_layers": 4, "num_experts": 32, "num_experts_per_tok": 4},
)
WIDE = Spec(
    "tiny-deepseek-v3-e300",
    4,
    (1, 2, 3),
    300,
    4,
    {
        "model_type": "deepseek_v3",
        "num_hidden_layers": 4,
        "first_k_dense_replace": 1,
        "n_routed_experts": 300,
        "num_experts_per_tok": 4,
    },
)


# -- wheels and source text ---------------------------------------------------------------------------------------
@dataclass
class SourceFile:
    """One Python file read out of a wheel (kept in memory only)."""

    wheel: Wheel
    path: str
    text: str

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()

    def line(self, needle: str, after: str | None = None) -> int:
        """1-based line of ``needle`` (after the first line containing ``after``); fails loudly when absent."""
        start = 0
        if after is not None:
            start = self.text.find(after)
            if start < 0:
                raise SystemExit(f"{self.wheel.label}:{self.path}: anchor {after!r} not found")
        pos = self.text.find(needle, start)
        if pos < 0:
            raise SystemExit(f"{self.wheel.label}:{self.path}: expected source text not found: {needle!r}")
        return self.text.count("\n", 0, pos) + 1

    def absent(self, needle: str) -> None:
        if needle in self.text:
            raise SystemExit(f"{self.wheel.label}:{self.path}: {needle!r} unexpectedly present")

    def node(self, qualname: str) -> ast.AST:
        """The top-level function/class, or ``Class.method``, named ``qualname``."""
        body: list[ast.stmt] = ast.parse(self.text).body
        found: ast.AST | None = None
        for part in qualname.split("."):
            found = next(
                (
                    n
                    for n in body
                    if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and n.name == part
                ),
                None,
            )
            if found is None:
                raise SystemExit(f"{self.wheel.label}:{self.path}: no definition {qualname!r}")
            body = found.body
        assert found is not None
        return found

    def segment(self, node: ast.AST) -> str:
        text = ast.get_source_segment(self.text, node, padded=True)
        if text is None:
            raise SystemExit(f"{self.wheel.label}:{self.path}: no source for node at line {node.lineno}")  # type: ignore[attr-defined]
        return textwrap.dedent(text)

    def enclosing(self, line: int) -> str:
        """Dotted name of the innermost class/function containing ``line``."""
        best: list[str] = []

        def walk(body: list[ast.stmt], prefix: list[str]) -> None:
            nonlocal best
            for node in body:
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                    end = node.end_lineno or node.lineno
                    if node.lineno <= line <= end:
                        best = [*prefix, node.name]
                        walk(node.body, best)

        walk(ast.parse(self.text).body, [])
        return ".".join(best) or "<module>"

    def named(self, needle: str, after: str | None = None) -> tuple[str, int]:
        """Enclosing definition and line of ``needle``."""
        line = self.line(needle, after)
        return self.enclosing(line), line

    def definition(self, qualname: str) -> str:
        return self.segment(self.node(qualname))

    def if_block(self, qualname: str, test: str, contains: str) -> tuple[str, int]:
        """The ``if <test>:`` block inside ``qualname`` whose text contains ``contains``, and its line."""
        for node in ast.walk(self.node(qualname)):
            if isinstance(node, ast.If) and ast.unparse(node.test) == test:
                text = self.segment(node)
                if contains in text:
                    return text, node.lineno
        raise SystemExit(f"{self.wheel.label}:{self.path}: no `if {test}:` block with {contains!r} in {qualname}")

    def expression(self, qualname: str, target: str) -> tuple[str, int]:
        """The right-hand side of the assignment to ``target`` inside ``qualname``, and its line."""
        for node in ast.walk(self.node(qualname)):
            if isinstance(node, ast.Assign) and any(ast.unparse(t) == target for t in node.targets):
                return ast.unparse(node.value), node.lineno
        raise SystemExit(f"{self.wheel.label}:{self.path}: no assignment to {target} in {qualname}")

    def fields(self, cls: str) -> list[str]:
        """Declared (annotated, public) fields of ``cls`` including bases defined in the same file, in order."""
        classes = {n.name: n for n in ast.parse(self.text).body if isinstance(n, ast.ClassDef)}
        out: list[str] = []

        def walk(name: str) -> None:
            node = classes.get(name)
            if node is None:
                return
            for base in node.bases:
                if isinstance(base, ast.Name):
                    walk(base.id)
            for stmt in node.body:
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                    name_ = stmt.target.id
                    if not name_.startswith("_") and name_ not in out:
                        out.append(name_)

        if cls not in classes:
            raise SystemExit(f"{self.wheel.label}:{self.path}: no class {cls}")
        walk(cls)
        return out

    def popped_when_none(self, cls: str) -> set[str]:
        """Keys a class's wrap serializer drops when None (``data.pop("x", None)``), or all keys (SGLang SglExt)."""
        node = self.node(cls)
        keys: set[str] = set()
        for sub in ast.walk(node):
            if (
                isinstance(sub, ast.Call)
                and isinstance(sub.func, ast.Attribute)
                and sub.func.attr == "pop"
                and sub.args
                and isinstance(sub.args[0], ast.Constant)
            ):
                keys.add(str(sub.args[0].value))
        if "if v is not None" in self.segment(node):
            keys.add("*")
        return keys


class Wheel:
    """A published wheel in the cache (downloaded on first use); reads single members only."""

    def __init__(self, dist: str, version: str, cache: Path) -> None:
        self.dist, self.version, self.cache = dist, version, cache
        self.label = f"{dist}=={version}"
        self._path: Path | None = None

    @property
    def path(self) -> Path:
        if self._path is None:
            folder = self.cache / f"{self.dist}-{self.version}"
            wheels = sorted(folder.glob("*.whl"))
            if not wheels:
                folder.mkdir(parents=True, exist_ok=True)
                print(f"downloading {self.label} into {folder}", file=sys.stderr)
                subprocess.run(
                    [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", self.label, "-d", str(folder)],
                    check=True,
                    stdin=subprocess.DEVNULL,
                )
                wheels = sorted(folder.glob("*.whl"))
            if len(wheels) != 1:
                raise SystemExit(f"{folder}: expected one wheel, found {[w.name for w in wheels]}")
            self._path = wheels[0]
        return self._path

    def read(self, member: str) -> SourceFile:
        with zipfile.ZipFile(self.path) as archive:
            try:
                text = archive.read(member).decode()
            except KeyError:
                raise SystemExit(f"{self.label}: {member} is not in {self.path.name}") from None
        return SourceFile(self, member, text)


class TensorLike:
    """Stands in for a CPU torch tensor where engine code only calls ``.numpy()``."""

    def __init__(self, array: npt.NDArray[Any]) -> None:
        self.array = array

    def numpy(self) -> npt.NDArray[Any]:
        return self.array


def namespace(**extra: Any) -> dict[str, Any]:
    """What extracted engine code may use: numpy, io, base64 (also as ``pybase64``: same bytes out)."""
    ns: dict[str, Any] = {
        "np": np,
        "io": io,
        "base64": base64,
        "pybase64": base64,
        "contextlib": contextlib,
        "__builtins__": __builtins__,
    }
    ns.update(extra)
    return ns


def run_source(source: str, ns: dict[str, Any], filename: str) -> dict[str, Any]:
    """Execute extracted engine code; annotations stay unevaluated (they name torch types)."""
    flags = __future__.annotations.compiler_flag
    exec(compile(source, filename, "exec", flags=flags, dont_inherit=True), ns)
    return ns


def load_def(src: SourceFile, qualname: str, **extra: Any) -> Any:
    """Execute one definition from the engine's source and return it."""
    ns = run_source(src.definition(qualname), namespace(**extra), f"<{src.wheel.label}:{src.path}:{qualname}>")
    return ns[qualname.rsplit(".", 1)[-1]]


def dump_model(src: SourceFile, cls: str, values: dict[str, Any], *, drop_none: Iterable[str] = ()) -> dict[str, Any]:
    """A pydantic/dataclass response object as its ``model_dump()``: every declared field in declaration order,
    ``values`` for the ones set, ``None`` for the rest; fails when ``values`` names a field the class lacks."""
    fields = src.fields(cls)
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise SystemExit(f"{src.wheel.label}:{src.path}: {cls} has no field(s) {unknown} (has {fields})")
    drop = set(drop_none)
    out = {}
    for name in fields:
        value = values.get(name)
        if value is None and ("*" in drop or name in drop):
            continue
        out[name] = value
    return out


# -- fixture bookkeeping ------------------------------------------------------------------------------------------
@dataclass
class Sample:
    sample_id: str
    expert_ids: IntArray  # [n_tokens, n_moe, K] logical, zeros where not valid
    valid: npt.NDArray[np.bool_]
    token_ids: IntArray


@dataclass
class Fixture:
    name: str
    engine: str
    version: str
    spec: Spec
    description: str
    files: dict[str, str] = field(default_factory=dict)
    sources: list[dict[str, Any]] = field(default_factory=list)
    wheels: dict[str, str] = field(default_factory=dict)
    samples: list[Sample] = field(default_factory=list)
    notes: dict[str, Any] = field(default_factory=dict)
    facts: list[tuple[str, str]] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    payload: dict[str, Any] = field(default_factory=dict)

    def use(self, src: SourceFile, names: Sequence[str], description: str, lines: dict[str, int] | None = None) -> None:
        """Record a source file: what was taken, which lines were asserted."""
        self.wheels[src.wheel.label] = src.wheel.path.name
        entry = next((s for s in self.sources if s["path"] == src.path and s["wheel"] == src.wheel.path.name), None)
        if entry is None:
            entry = {
                "wheel": src.wheel.path.name,
                "path": src.path,
                "sha256": src.sha256,
                "names": [],
                "lines": {},
                "description": [],
            }
            self.sources.append(entry)
        entry["names"] += [n for n in names if n not in entry["names"]]
        entry["lines"].update(lines or {})
        entry["description"].append(description)

    def fact(self, src: SourceFile | str, line: int | None, text: str) -> None:
        where = src if isinstance(src, str) else f"{src.wheel.label} `{src.path}`" + (f":{line}" if line else "")
        self.facts.append((where, text))

    def add(self, sample_id: str, ids_moe: IntArray, valid: npt.NDArray[np.bool_], tokens: IntArray) -> None:
        ids = np.where(valid[:, None, None], ids_moe, 0).astype(np.int64)
        self.samples.append(Sample(sample_id, ids, valid.astype(bool), np.asarray(tokens, dtype=np.int64)))

    def write(self, out: Path) -> None:
        folder = out / self.name
        if folder.exists():
            shutil.rmtree(folder)
        folder.mkdir(parents=True)
        for fname, content in self.payload.items():
            path = folder / fname
            if fname.endswith(".jsonl"):
                path.write_text("".join(json.dumps(obj, separators=(",", ":")) + "\n" for obj in content))
            elif fname.endswith(".json"):
                path.write_text(json.dumps(content, indent=1) + "\n")
            elif fname.endswith(".npz"):
                np.savez_compressed(path, **content)
            elif fname.endswith(".npy"):
                np.save(path, content, allow_pickle=False)
            else:
                raise SystemExit(f"unknown payload file type {fname}")
        arrays: dict[str, Any] = {"sample_ids": np.array([s.sample_id for s in self.samples])}
        for i, sample in enumerate(self.samples):
            arrays[f"{i}_expert_ids"] = sample.expert_ids
            arrays[f"{i}_valid"] = sample.valid
            arrays[f"{i}_token_ids"] = sample.token_ids
        np.savez_compressed(folder / "expected.npz", **arrays)
        (folder / "model_spec.json").write_text(json.dumps(self.spec.model_spec_json(), indent=1) + "\n")
        if self.notes:
            (folder / "notes.json").write_text(json.dumps(self.notes, indent=1) + "\n")
        source = {
            "fixture": self.name,
            "engine": self.engine,
            "version": self.version,
            "description": self.description,
            "wheels": self.wheels,
            "model_hf_config": self.spec.hf_config,
            "files": self.files,
            "sources": [{**s, "description": " ".join(s["description"])} for s in self.sources],
            "facts": [{"where": w, "fact": t} for w, t in self.facts],
            **self.extra,
        }
        (folder / "SOURCE.json").write_text(json.dumps(source, indent=1) + "\n")


# -- routing ground truth -----------------------------------------------------------------------------------------
def rng_for(name: str) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(name.encode()))


def routes(rng: np.random.Generator, n: int, spec: Spec) -> IntArray:
    """``[n, n_moe, K]`` distinct logical expert IDs per row in score order (not sorted)."""
    scores = rng.random((n, spec.n_moe, spec.num_experts))
    return np.argsort(-scores, axis=-1)[..., : spec.topk].astype(np.int64)


def tokens(rng: np.random.Generator, n: int) -> IntArray:
    return rng.integers(1000, 50000, n).astype(np.int64)


def full_axis(ids_moe: IntArray, spec: Spec) -> IntArray:
    """The engine's capture on the full decoder axis: MoE layer ``moe_layers[j]`` holds column j, dense layers 0."""
    out = np.zeros((ids_moe.shape[0], spec.num_layers, spec.topk), dtype=np.int64)
    out[:, list(spec.moe_layers)] = ids_moe
    return out


def span(n: int, start: int, stop: int) -> npt.NDArray[np.bool_]:
    valid = np.zeros(n, dtype=bool)
    valid[start:stop] = True
    return valid


def b64_npy_load(text: str) -> npt.NDArray[Any]:
    return np.asarray(np.load(io.BytesIO(base64.b64decode(text)), allow_pickle=False))


# -- builders -----------------------------------------------------------------------------------------------------
@dataclass
class Ctx:
    cache: Path

    def wheel(self, dist: str, version: str) -> Wheel:
        return Wheel(dist, version, self.cache)


Builder = Callable[[Ctx], Fixture]
BUILDERS: dict[str, Builder] = {}


def builder(name: str) -> Callable[[Builder], Builder]:
    def register(fn: Builder) -> Builder:
        BUILDERS[name] = fn
        return fn

    return register


# ---- vLLM: in-process (0.14.x / 0.16), KV-slot host buffer read back by the scheduler ----
class _Blocks:
    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    def get_block_ids(self) -> list[list[int]]:
        return [self.ids]


def _vllm_slot_readback(
    scheduler: SourceFile,
    version: str,
    host: npt.NDArray[np.int32],
    block_ids: list[int],
    num_tokens: int,
    block_size: int,
) -> tuple[npt.NDArray[np.int32], int]:
    """Run the scheduler's own read-back code (slot mapping from the request's KV blocks, ``num_tokens - 1`` rows)
    against a host buffer indexed by KV slot."""
    reader = types.SimpleNamespace(get_routed_experts=lambda indices: host[indices, :, :].copy())
    fake_self = types.SimpleNamespace(
        vllm_config=types.SimpleNamespace(model_config=types.SimpleNamespace(enable_return_routed_experts=True)),
        kv_cache_manager=types.SimpleNamespace(get_blocks=lambda _rid: _Blocks(block_ids)),
        block_size=block_size,
        routed_experts_reader=reader,
    )
    request = types.SimpleNamespace(request_id="req", num_tokens=num_tokens)
    if version == "0.14.1":
        code, line = scheduler.if_block(
            "Scheduler.update_from_output",
            "self.vllm_config.model_config.enable_return_routed_experts",
            "get_routed_experts(",
        )
        ns = run_source(
            code, namespace(self=fake_self, request=request, routed_experts=None), "<vllm-0.14.1 update_from_output>"
        )
        return np.asarray(ns["routed_experts"]), line
    method = load_def(scheduler, "Scheduler._get_routed_experts")
    return np.asarray(method(fake_self, request)), scheduler.line("def _get_routed_experts")


def _vllm_inprocess(ctx: Ctx, version: str, name: str, *, eplb: bool) -> Fixture:
    spec = DEEPSEEK
    wheel = ctx.wheel("vllm", version)
    fx = Fixture(name, "vllm", version, spec, "")
    outputs = wheel.read("vllm/outputs.py")
    scheduler = wheel.read("vllm/v1/core/sched/scheduler.py")
    capturer = wheel.read("vllm/model_executor/layers/fused_moe/routed_experts_capturer.py")
    layer = wheel.read("vllm/model_executor/layers/fused_moe/layer.py")
    fx.use(
        outputs,
        ["CompletionOutput", "RequestOutput"],
        "Field names of the in-process output objects.",
        {"CompletionOutput.routed_experts": outputs.line("routed_experts: np.ndarray | None = None")},
    )
    fx.fact(
        outputs,
        outputs.line("routed_experts: np.ndarray | None = None"),
        "`CompletionOutput.routed_experts: np.ndarray | None` (in-process only; no HTTP field in this version)",
    )
    init_line = capturer.line("num_layers = hf_config.num_hidden_layers")
    fx.use(
        capturer,
        ["RoutedExpertsCapturer.init_buffer"],
        "Host buffer (max_num_kv_tokens, num_hidden_layers, K) int32 indexed by KV slot.",
        {"num_layers": init_line, "int32": capturer.line("dtype=np.int32, buffer=self._shm.buf")},
    )
    fx.fact(
        capturer,
        init_line,
        "layer axis = `hf_config.num_hidden_layers` (full axis, dense layers stay 0); "
        "host buffer int32 in POSIX shared memory indexed by KV slot",
    )

    block_size = 4
    rng = rng_for(name)
    # request A (cold) and request B whose first 8 tokens (2 blocks) hit A's prefix-cache blocks
    p_a, r_a, p_b, r_b, shared = 10, 5, 11, 4, 8
    tok_a = tokens(rng, p_a + r_a)
    tok_b = np.concatenate([tok_a[:shared], tokens(rng, p_b + r_b - shared)])
    ids_a = routes(rng, p_a + r_a, spec)
    ids_b = np.concatenate([ids_a[:shared], routes(rng, p_b + r_b - shared, spec)])  # same prefix, same routing
    blocks_a = [5, 2, 9, 7]
    blocks_b = [5, 2, 11, 3, 8]
    n_phys = spec.num_experts
    host = np.zeros((16 * block_size, spec.num_layers, spec.topk), dtype=np.int32)

    if eplb:
        eplb_src = wheel.read("vllm/distributed/eplb/eplb_state.py")
        fused = wheel.read("vllm/model_executor/layers/fused_moe/fused_moe.py")
        build_initial = load_def(eplb_src, "EplbState.build_initial_global_physical_to_logical_map")
        redundant = 16
        initial = list(build_initial(spec.num_experts, redundant))
        n_phys = len(initial)
        p2l = np.empty((spec.n_moe, n_phys), dtype=np.int64)
        p2l[0] = initial
        for j in range(1, spec.n_moe):  # later layers after a rebalance: a permutation of the same multiset
            p2l[j] = np.asarray(initial)[rng.permutation(n_phys)]
        sel = fused.line("replica_indices = (pos_indices % replica_count).unsqueeze(-1)")
        fx.use(
            eplb_src,
            ["EplbState.build_initial_global_physical_to_logical_map"],
            "Executed to build layer 0's physical->logical table; shape [num_moe_layers, num_physical_experts] "
            "(EplbModelState docstring).",
            {"build_initial": eplb_src.line("def build_initial_global_physical")},
        )
        fx.use(
            fused,
            ["eplb_map_to_physical_and_record"],
            "Replica choice (flat position in the forward batch modulo the replica count) reproduced with numpy.",
            {"replica_indices": sel},
        )
        capture_line = layer.line("capturer.capture(  # noqa")
        eplb_line = layer.line("topk_ids = eplb_map_to_physical_and_record(")
        fx.use(
            layer,
            [layer.enclosing(capture_line), "FusedMoE.layer_id"],
            "Capture runs after the EPLB mapping: "
            "physical IDs; layer_id = extract_layer_index(layer_name) (global index).",
            {"eplb_map": eplb_line, "capture": capture_line},
        )
        fx.fact(
            layer,
            capture_line,
            f"capture after `eplb_map_to_physical_and_record` (line {eplb_line}): "
            "**physical** expert IDs under EPLB; layer id = `extract_layer_index(self.layer_name)`",
        )
        fx.fact(fused, sel, "replica = (flat index in the forward batch's topk_ids) % replica_count")

        def to_physical(ids_full: IntArray, flat_offset0: IntArray) -> IntArray:
            out = ids_full.copy()
            for j, layer_idx in enumerate(spec.moe_layers):
                l2p: dict[int, list[int]] = {}
                for phys, logical in enumerate(p2l[j]):
                    l2p.setdefault(int(logical), []).append(phys)
                for t in range(ids_full.shape[0]):
                    for k in range(spec.topk):
                        replicas = l2p[int(ids_full[t, layer_idx, k])]
                        out[t, layer_idx, k] = replicas[int(flat_offset0[t] + k) % len(replicas)]
            return out
    else:
        router = wheel.read("vllm/model_executor/layers/fused_moe/router/base_router.py")
        runner = wheel.read("vllm/v1/worker/gpu_model_runner.py")
        cap = router.line("# Capture logical ids before EPLB mapping.")
        fx.use(
            router,
            ["BaseRouter.select_experts"],
            "capture_fn runs before _apply_eplb_mapping: logical IDs.",
            {"capture_logical": cap},
        )
        bind = runner.line("layer_id = module.layer_id", after="def _bind_routed_experts_capturer")
        fx.use(
            runner,
            ["GPUModelRunner._bind_routed_experts_capturer"],
            "Binds capture_fn with FusedMoE.layer_id (global decoder index).",
            {"bind": bind},
        )
        fx.fact(router, cap, "capture before EPLB mapping: **logical** IDs")
        fx.fact(runner, bind, "capturer bound per FusedMoE with `module.layer_id` (global layer index)")

    request_outputs = []
    arrays: dict[str, Any] = {}
    for rid, toks, ids, blocks, p, computed_from in (
        ("req-A", tok_a, ids_a, blocks_a, p_a, 0),
        ("req-B", tok_b, ids_b, blocks_b, p_b, shared),
    ):
        n = toks.shape[0]
        captured = full_axis(ids, spec)
        if eplb:
            # prefill runs the uncached prompt tokens as one batch, each decode step one token
            offset = np.zeros(n, dtype=np.int64)
            offset[computed_from:p] = (np.arange(p - computed_from)) * spec.topk
            captured = to_physical(captured, offset)
        slots = (np.array(blocks)[:, None] * block_size + np.arange(block_size)).ravel()
        host[slots[computed_from : n - 1]] = captured[computed_from : n - 1]  # forwarded tokens only
        rows, line = _vllm_slot_readback(scheduler, version, host, blocks, n, block_size)
        key = f"{rid}.outputs.0.routed_experts"
        arrays[key] = rows
        request_outputs.append(
            {
                "request_id": rid,
                "prompt_token_ids": toks[:p].tolist(),
                "num_cached_tokens": computed_from,
                "finished": True,
                "outputs": [
                    {
                        "index": 0,
                        "text": "",
                        "token_ids": toks[p:].tolist(),
                        "finish_reason": "length",
                        "stop_reason": None,
                        "routed_experts": {"npz": "routed_experts.npz", "key": key},
                    }
                ],
            }
        )
        fx.add(f"{rid}/0", ids, span(n, 0, n - 1), toks)
    fx.use(
        scheduler,
        ["Scheduler._get_routed_experts" if version != "0.14.1" else "Scheduler.update_from_output"],
        "Executed: slot mapping from the request's KV blocks, `num_tokens - 1` rows read from the host buffer "
        "(prefix-cache hits read the shared blocks' slots, so they come back filled).",
        {"readback": line},
    )
    fx.fact(
        scheduler,
        line,
        "on stop: rows = host_buffer[slot_mapping[: request.num_tokens - 1]] -> "
        "[num_tokens - 1, num_hidden_layers, K] int32; prefix-cache hits filled (KV slot read-back)",
    )
    fx.payload["request_outputs.json"] = request_outputs
    fx.payload["routed_experts.npz"] = arrays
    fx.files = {
        "request_outputs.json": "RequestOutput fields (request_id, prompt_token_ids, num_cached_tokens, outputs[i]."
        "token_ids, finish_reason); outputs[i].routed_experts points at an array in routed_experts.npz",
        "routed_experts.npz": "CompletionOutput.routed_experts arrays as the engine returned them (int32, full "
        "axis, n_tokens - 1 rows)",
    }
    if eplb:
        fx.payload["eplb_physical_to_logical.npy"] = p2l
        fx.files["eplb_physical_to_logical.npy"] = (
            "vLLM EplbModelState.physical_to_logical_map for this run, [num_moe_layers, num_physical_experts]; "
            "row j is MoE layer moe_layers[j]"
        )
        fx.extra["eplb"] = {
            "ids_in_payload": "physical",
            "num_physical_experts": n_phys,
            "table_axis": "MoE-only (row j = global layer moe_layers[j])",
            "versions_capturing_physical": ["0.14.x", "0.15.x (all zeros anyway)", "0.21.0"],
            "versions_capturing_logical": ["0.16.0-0.20.x", "0.22.0+"],
        }
        fx.description = (
            "vLLM 0.14.1 in-process CompletionOutput.routed_experts under EPLB: PHYSICAL expert IDs "
            "(captured after the logical->physical mapping), full decoder axis int32, with the EPLB "
            "physical->logical table. req-B hits req-A's prefix blocks (rows filled)."
        )
    else:
        fx.description = (
            "vLLM 0.16.0 in-process CompletionOutput.routed_experts: int32, full decoder axis (dense "
            "layers 0), n_tokens - 1 rows; req-B hits req-A's 2 prefix blocks and gets them filled."
        )
    return fx


@builder("vllm-0.16.0-inprocess")
def vllm_016_inprocess(ctx: Ctx) -> Fixture:
    return _vllm_inprocess(ctx, "0.16.0", "vllm-0.16.0-inprocess", eplb=False)


@builder("vllm-0.14.1-inprocess-eplb")
def vllm_0141_eplb(ctx: Ctx) -> Fixture:
    return _vllm_inprocess(ctx, "0.14.1", "vllm-0.14.1-inprocess-eplb", eplb=True)


# ---- vLLM 0.21: MoE-only int16 axis, prompt rows once per response ----
class _V021:
    def __init__(self, ctx: Ctx, fx: Fixture) -> None:
        wheel = ctx.wheel("vllm", "0.21.0")
        self.fx = fx
        self.capturer = wheel.read("vllm/model_executor/layers/fused_moe/routed_experts_capturer.py")
        self.count = load_def(self.capturer, "_count_moe_layers")
        self.split = load_def(self.capturer, "split_routed_experts")
        self.cmpl_proto = wheel.read("vllm/entrypoints/openai/completion/protocol.py")
        self.cmpl_serving = wheel.read("vllm/entrypoints/openai/completion/serving.py")
        self.chat_proto = wheel.read("vllm/entrypoints/openai/chat_completion/protocol.py")
        self.chat_serving = wheel.read("vllm/entrypoints/openai/chat_completion/serving.py")
        self.engine = wheel.read("vllm/v1/engine/__init__.py")
        self.outproc = wheel.read("vllm/v1/engine/output_processor.py")
        c = self.capturer
        fx.use(
            c,
            ["_count_moe_layers", "split_routed_experts"],
            "Executed: the MoE-layer count that sizes the "
            "int16 buffers (ignores first_k_dense_replace) and the prompt/generation split.",
            {
                "DTYPE": c.line("DTYPE = np.int16"),
                "count": c.line("def _count_moe_layers"),
                "num_hidden_layers": c.line("self.num_hidden_layers = _count_moe_layers(model_config.hf_text_config)"),
                "extract_on_predicted_finish": c.line("def extract_routed_experts_for_current_batch"),
                "preempted_dropped": c.line("dropped without being emitted on a ``ModelRunnerOutput``"),
            },
        )
        layer = wheel.read("vllm/model_executor/layers/fused_moe/layer.py")
        runner = wheel.read("vllm/model_executor/layers/fused_moe/runner/moe_runner.py")
        replay = runner.line("routing_replay_out[: topk_ids.shape[0]].copy_(topk_ids.to(torch.int16))")
        fx.use(
            layer,
            ["FusedMoE.__init__"],
            "moe_layer_id is a sequential counter over FusedMoE modules.",
            {"moe_layer_id": layer.line("self.moe_layer_id = FusedMoE._next_moe_layer_id")},
        )
        fx.use(
            runner,
            ["MoERunner._apply_quant_method"],
            "routing written after router.select_experts (which applies the EPLB mapping): physical IDs under EPLB.",
            {"routing_replay_out": replay},
        )
        fx.use(
            self.engine,
            ["FINISH_REASON_STRINGS"],
            "finish_reason strings.",
            {"FINISH_REASON_STRINGS": self.engine.line("FINISH_REASON_STRINGS = (")},
        )
        fx.fact(
            c,
            c.line("DTYPE = np.int16"),
            "device/host buffers int16; host buffer per request indexed by token "
            "position (prefix-cache hits are never scattered: zero rows)",
        )
        fx.fact(
            c,
            c.line("def _count_moe_layers"),
            "layer axis length = `_count_moe_layers(hf_text_config)`: "
            "handles layers_block_type / decoder_sparse_step / mlp_only_layers, NOT first_k_dense_replace "
            f"(tiny DeepSeek spec: {self.count(types.SimpleNamespace(**DEEPSEEK.hf_config))} layers for "
            f"{DEEPSEEK.n_moe} MoE layers -> trailing all-zero layers)",
        )
        fx.fact(
            layer,
            layer.line("self.moe_layer_id = FusedMoE._next_moe_layer_id"),
            "MoE layer index = sequential counter (j-th FusedMoE built -> column j): MoE-only axis",
        )
        fx.fact(
            runner,
            replay,
            "routing copied after `router.select_experts()` (post-EPLB): **physical** IDs; "
            "`BaseRouter.capture_fn` exists but nothing calls `set_capture_fn`",
        )
        fx.fact(
            c,
            c.line("def extract_routed_experts_for_current_batch"),
            "rows extracted only for requests "
            "predicted to finish in the runner (EOS, stop_token_ids, max_tokens, max_model_len): stop STRINGS "
            "are not predicted -> routed_experts None",
        )
        fx.fact(
            c,
            c.line("dropped without being emitted on a ``ModelRunnerOutput``"),
            "preempted requests: host buffer freed, routed_experts None, no other signal",
        )

    def axis(self, spec: Spec) -> int:
        return int(self.count(types.SimpleNamespace(**spec.hf_config)))

    def engine_rows(self, ids_moe: IntArray, spec: Spec, computed_from: int) -> npt.NDArray[np.int16]:
        """Host buffer rows [0, n-1) as 0.21 fills them: column j = j-th MoE layer, zeros for never-scheduled
        (prefix-cache) positions and for the extra layers the count adds."""
        n = ids_moe.shape[0]
        buf = np.zeros((n - 1, self.axis(spec), spec.topk), dtype=np.int16)
        buf[computed_from:, : spec.n_moe] = ids_moe[computed_from : n - 1]
        return buf

    def choice_rows(self, rows: npt.NDArray[np.int16], prompt_len: int, n_out: int) -> tuple[Any, Any]:
        pair: tuple[Any, Any] = self.split(rows, prompt_len, n_out)
        return pair


@builder("vllm-0.21.0-completions-multiprompt")
def vllm_021_completions(ctx: Ctx) -> Fixture:
    name = "vllm-0.21.0-completions-multiprompt"
    spec = DEEPSEEK
    fx = Fixture(
        name,
        "vllm",
        "0.21.0",
        spec,
        "vLLM 0.21.0 /v1/completions with three token prompts in one request: "
        "response-level prompt_routed_experts (int16 nested lists, MoE-only axis counted without "
        "first_k_dense_replace -> 2 trailing zero layers) is taken from the FIRST result only, so prompts "
        "1 and 2 get prompt 0's prompt rows (silent misread); choices[i].routed_experts = generation rows.",
    )
    v = _V021(ctx, fx)
    s = v.cmpl_serving
    where, pre = s.named("pre = final_res_batch[0].prompt_routed_experts")
    tolist = s.line("output.routed_experts.tolist()")
    fx.use(
        s,
        [where],
        "prompt_routed_experts from "
        "final_res_batch[0] only; choices' routed_experts = CompletionOutput.routed_experts.tolist().",
        {"prompt_routed_experts_first_result": pre, "choice_tolist": tolist},
    )
    fx.use(
        v.cmpl_proto,
        ["CompletionResponse", "CompletionResponseChoice"],
        "Response field names.",
        {
            "choice.routed_experts": v.cmpl_proto.line("routed_experts: list[list[list[int]]] | None = None"),
            "prompt_routed_experts": v.cmpl_proto.line("prompt_routed_experts: list[list[list[int]]] | None"),
        },
    )
    fx.fact(
        s,
        pre,
        "/v1/completions: `prompt_routed_experts = final_res_batch[0].prompt_routed_experts.tolist()` "
        "-> with several prompts only prompt 0's prompt rows are returned",
    )
    fx.fact(
        v.cmpl_proto,
        v.cmpl_proto.line("prompt_routed_experts: list[list[list[int]]] | None"),
        "response-level `prompt_routed_experts` [prompt_len, L', K] + `choices[i].routed_experts` "
        "[gen_len - 1, L', K], nested JSON int lists",
    )
    where, split_line = v.outproc.named("prompt_routed_experts, gen_routed_experts = split_routed_experts(")
    fx.use(
        v.outproc,
        [where],
        "split into prompt rows [:prompt_len] (RequestOutput) "
        "and generation rows (CompletionOutput), either None when empty.",
        {"split": split_line},
    )
    fx.fact(
        v.outproc,
        split_line,
        "prompt rows [:prompt_len] -> RequestOutput.prompt_routed_experts; rows "
        "[prompt_len:] -> CompletionOutput.routed_experts (None when 0 rows, e.g. a 1-token output)",
    )

    rng = rng_for(name)
    lens = [(7, 4), (7, 5), (6, 3)]  # prompt 1 has prompt 0's length: its misread passes every shape check
    prompts: list[list[int]] = []
    request = {"model": spec.name, "prompt": prompts, "max_tokens": 5, "return_token_ids": True}
    choices = []
    first_prompt_rows = None
    for i, (p, r) in enumerate(lens):
        toks = tokens(rng, p + r)
        ids = routes(rng, p + r, spec)
        prompts.append(toks[:p].tolist())
        rows = v.engine_rows(ids, spec, 0)
        prompt_rows, gen_rows = v.choice_rows(rows, p, r)
        if i == 0:
            first_prompt_rows = prompt_rows
        choices.append(
            dump_model(
                v.cmpl_proto,
                "CompletionResponseChoice",
                {
                    "index": i,
                    "text": f"<detokenized {r} tokens>",
                    "finish_reason": "length",
                    "prompt_token_ids": toks[:p].tolist(),
                    "token_ids": toks[p:].tolist(),
                    "routed_experts": None if gen_rows is None else gen_rows.tolist(),
                },
            )
        )
        valid = span(p + r, 0, p + r - 1)
        if i > 0:
            valid[:p] = False  # the response carries prompt 0's rows, not this prompt's
        fx.add(f"cmpl-021multi/{i}", ids, valid, toks)
    assert first_prompt_rows is not None
    usage = {
        "prompt_tokens": sum(p for p, _ in lens),
        "total_tokens": sum(p + r for p, r in lens),
        "completion_tokens": sum(r for _, r in lens),
        "prompt_tokens_details": None,
    }
    fx.payload["request.json"] = request
    fx.payload["response.json"] = dump_model(
        v.cmpl_proto,
        "CompletionResponse",
        {
            "id": "cmpl-021multi",
            "object": "text_completion",
            "created": 1767225600,
            "model": spec.name,
            "prompt_routed_experts": first_prompt_rows.tolist(),
            "choices": choices,
            "usage": usage,
        },
    )
    fx.notes = {
        "1": {"prompt_rows_unknown": True, "why": "prompt_routed_experts holds prompt 0's rows (final_res_batch[0])"},
        "2": {"prompt_rows_unknown": True, "why": "prompt_routed_experts holds prompt 0's rows (final_res_batch[0])"},
        "layer_axis": f"{v.axis(spec)} layers: MoE layers 0..{spec.n_moe - 1} in columns 0..{spec.n_moe - 1}, "
        "then zeros (first_k_dense_replace not subtracted)",
    }
    fx.files = {
        "request.json": "the /v1/completions request (token prompts, return_token_ids)",
        "response.json": "the CompletionResponse as vLLM 0.21.0 serializes it",
    }
    fx.extra["prompt_rows_rule"] = (
        "vLLM 0.21.0 sets response.prompt_routed_experts = final_res_batch[0]."
        "prompt_routed_experts (completion/serving.py); for prompt i > 0 the prompt rows "
        "are NOT in the response (they are prompt 0's). expected.npz marks them invalid."
    )
    return fx


@builder("vllm-0.21.0-chat-prefixcache")
def vllm_021_chat(ctx: Ctx) -> Fixture:
    name = "vllm-0.21.0-chat-prefixcache"
    spec = DEEPSEEK
    fx = Fixture(
        name,
        "vllm",
        "0.21.0",
        spec,
        "vLLM 0.21.0 /v1/chat/completions whose first 8 prompt tokens hit the "
        "prefix cache: those prompt rows are zeros (never scattered into the per-request host buffer); "
        "MoE-only int16 axis with 2 trailing zero layers for the DeepSeek-style spec.",
    )
    v = _V021(ctx, fx)
    s = v.chat_serving
    where, line = s.named("prompt_routed_experts = final_res.prompt_routed_experts.tolist()")
    fx.use(
        s,
        [where],
        "prompt_routed_experts from the request's RequestOutput; choices' routed_experts = .tolist().",
        {"prompt_routed_experts": line},
    )
    fx.use(v.chat_proto, ["ChatCompletionResponse", "ChatCompletionResponseChoice"], "Response field names.")
    fx.fact(s, line, "/v1/chat/completions: response-level `prompt_routed_experts` from its single RequestOutput")
    rng = rng_for(name)
    p, r, cached = 12, 5, 8
    toks = tokens(rng, p + r)
    ids = routes(rng, p + r, spec)
    prompt_rows, gen_rows = v.choice_rows(v.engine_rows(ids, spec, cached), p, r)
    choice = dump_model(
        v.chat_proto,
        "ChatCompletionResponseChoice",
        {
            "index": 0,
            "message": dump_model(
                v.chat_proto, "ChatMessage", {"role": "assistant", "content": "<detokenized>", "tool_calls": []}
            ),
            "finish_reason": "length",
            "token_ids": toks[p:].tolist(),
            "routed_experts": gen_rows.tolist(),
        },
    )
    fx.payload["request.json"] = {
        "model": spec.name,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": r,
        "return_token_ids": True,
    }
    fx.payload["response.json"] = dump_model(
        v.chat_proto,
        "ChatCompletionResponse",
        {
            "id": "chatcmpl-021prefix",
            "object": "chat.completion",
            "created": 1767225600,
            "model": spec.name,
            "prompt_routed_experts": prompt_rows.tolist(),
            "choices": [choice],
            "usage": {
                "prompt_tokens": p,
                "total_tokens": p + r,
                "completion_tokens": r,
                "prompt_tokens_details": {"cached_tokens": cached},
            },
            "prompt_token_ids": toks[:p].tolist(),
        },
    )
    fx.add("chatcmpl-021prefix", ids, span(p + r, cached, p + r - 1), toks)
    fx.notes = {
        "0": {"prefix_cached_rows": [0, cached], "why": "prefix-cache hit: 0.21 has no restore path, rows are zeros"}
    }
    fx.files = {"request.json": "chat request", "response.json": "ChatCompletionResponse (vLLM 0.21.0)"}
    return fx


@builder("vllm-0.21.0-completions-stopstring")
def vllm_021_stop(ctx: Ctx) -> Fixture:
    name = "vllm-0.21.0-completions-stopstring"
    spec = QWEN
    fx = Fixture(
        name,
        "vllm",
        "0.21.0",
        spec,
        "vLLM 0.21.0 /v1/completions that ended on a stop STRING: the "
        "frontend detokenizer finishes the request, the runner never predicted the finish, so "
        "routed_experts and prompt_routed_experts are null; finish_reason 'stop', stop_reason = the string.",
    )
    v = _V021(ctx, fx)
    where, stop_line = v.outproc.named("finish_reason = FinishReason.STOP")
    fx.use(
        v.outproc,
        [where],
        "stop string detected in the frontend: finish_reason "
        "STOP, stop_reason = the string, routed_experts only from EngineCoreOutput (None here).",
        {"stop_string": stop_line},
    )
    fx.use(v.cmpl_proto, ["CompletionResponse", "CompletionResponseChoice"], "Response field names.")
    fx.fact(
        v.outproc,
        stop_line,
        "stop string -> finish_reason 'stop', stop_reason '<string>'; "
        "routed_experts/prompt_routed_experts null (0.21.0)",
    )
    rng = rng_for(name)
    p, r = 6, 4
    toks = tokens(rng, p + r)
    ids = routes(rng, p + r, spec)
    fx.payload["request.json"] = {
        "model": spec.name,
        "prompt": toks[:p].tolist(),
        "max_tokens": 16,
        "stop": ["</answer>"],
        "return_token_ids": True,
    }
    fx.payload["response.json"] = dump_model(
        v.cmpl_proto,
        "CompletionResponse",
        {
            "id": "cmpl-021stop",
            "object": "text_completion",
            "created": 1767225600,
            "model": spec.name,
            "prompt_routed_experts": None,
            "choices": [
                dump_model(
                    v.cmpl_proto,
                    "CompletionResponseChoice",
                    {
                        "index": 0,
                        "text": "<answer>42",
                        "finish_reason": "stop",
                        "stop_reason": "</answer>",
                        "prompt_token_ids": toks[:p].tolist(),
                        "token_ids": toks[p:].tolist(),
                        "routed_experts": None,
                    },
                )
            ],
            "usage": {"prompt_tokens": p, "total_tokens": p + r, "completion_tokens": r, "prompt_tokens_details": None},
        },
    )
    fx.add("cmpl-021stop", ids, np.zeros(p + r, dtype=bool), toks)
    fx.notes = {"0": {"routing_absent": True, "why": "stop-string finish: vLLM 0.21.0 returns null routing"}}
    fx.files = {"request.json": "request with a stop string", "response.json": "CompletionResponse (null routing)"}
    return fx


@builder("vllm-0.21.0-completions-abort")
def vllm_021_abort(ctx: Ctx) -> Fixture:
    name = "vllm-0.21.0-completions-abort"
    spec = QWEN
    fx = Fixture(
        name,
        "vllm",
        "0.21.0",
        spec,
        "vLLM 0.21.0: an aborted request (finish_reason 'abort', null "
        "routing) and a request that was preempted and finished normally (finish_reason 'length', null "
        "routing, no marker at all).",
    )
    v = _V021(ctx, fx)
    where, abort_line = v.outproc.named("finish_reason=FinishReason.ABORT")
    fx.use(
        v.outproc,
        [where],
        "abort produces a final output with FinishReason.ABORT and no routed_experts.",
        {"abort": abort_line},
    )
    fx.use(v.cmpl_proto, ["CompletionResponse", "CompletionResponseChoice"], "Response field names.")
    fx.fact(
        v.outproc,
        abort_line,
        "abort: final output finish_reason 'abort', routed_experts None (0.21 passes no routing on the abort path)",
    )
    rng = rng_for(name)
    responses = []
    for i, (finish, p, r) in enumerate((("abort", 6, 3), ("length", 7, 4))):
        toks = tokens(rng, p + r)
        ids = routes(rng, p + r, spec)
        responses.append(
            dump_model(
                v.cmpl_proto,
                "CompletionResponse",
                {
                    "id": f"cmpl-021abort{i}",
                    "object": "text_completion",
                    "created": 1767225600,
                    "model": spec.name,
                    "prompt_routed_experts": None,
                    "choices": [
                        dump_model(
                            v.cmpl_proto,
                            "CompletionResponseChoice",
                            {
                                "index": 0,
                                "text": "<partial>",
                                "finish_reason": finish,
                                "prompt_token_ids": toks[:p].tolist(),
                                "token_ids": toks[p:].tolist(),
                                "routed_experts": None,
                            },
                        )
                    ],
                    "usage": {
                        "prompt_tokens": p,
                        "total_tokens": p + r,
                        "completion_tokens": r,
                        "prompt_tokens_details": None,
                    },
                },
            )
        )
        fx.add(f"cmpl-021abort{i}", ids, np.zeros(p + r, dtype=bool), toks)
    fx.payload["responses.json"] = responses
    fx.notes = {
        "0": {"routing_absent": True, "why": "aborted"},
        "1": {
            "routing_absent": True,
            "why": "preempted then resumed: 0.21 frees the host buffer; the "
            "response is indistinguishable from a server without --enable-return-routed-experts",
        },
    }
    fx.files = {"responses.json": "two CompletionResponses: [0] aborted, [1] preempted (finished by length)"}
    return fx


# ---- vLLM 0.22+: base64 .npy per choice, full axis uint8/uint16 ----
class _V022Plus:
    """Encoding and dtype rules of one vLLM version >= 0.22, executed from its own files."""

    def __init__(self, ctx: Ctx, fx: Fixture, version: str) -> None:
        self.version = version
        wheel = ctx.wheel("vllm", version)
        self.fx = fx
        self.wheel = wheel
        self.cmpl_proto = wheel.read("vllm/entrypoints/openai/completion/protocol.py")
        self.cmpl_serving = wheel.read("vllm/entrypoints/openai/completion/serving.py")
        self.chat_proto = wheel.read("vllm/entrypoints/openai/chat_completion/protocol.py")
        self.chat_serving = wheel.read("vllm/entrypoints/openai/chat_completion/serving.py")
        self.sampling = wheel.read("vllm/sampling_params.py")
        capturer = wheel.read("vllm/model_executor/layers/fused_moe/routed_experts_capturer.py")
        sp_line = self.sampling.line("routed_experts_prompt_start: int = 0")
        fx.use(
            self.sampling,
            ["SamplingParams.routed_experts_prompt_start"],
            "per-request start offset field.",
            {"routed_experts_prompt_start": sp_line},
        )
        fx.fact(self.sampling, sp_line, "`SamplingParams.routed_experts_prompt_start: int = 0` (rows start there)")
        if "numpy2base64" in self.cmpl_serving.text:
            serial = wheel.read("vllm/utils/serial_utils.py")
            fn = load_def(serial, "numpy2base64")
            self.encode: Callable[[npt.NDArray[Any]], str] = fn
            fx.use(
                serial,
                ["numpy2base64"],
                "Executed: np.save(allow_pickle=False) + pybase64.b64encode (stdlib base64 gives identical bytes).",
                {"numpy2base64": serial.line("def numpy2base64")},
            )
            fx.fact(
                serial,
                serial.line("def numpy2base64"),
                "encoding: `numpy2base64` = base64(np.save(array, "
                "allow_pickle=False)); serving calls it for choices[i].routed_experts",
            )
        else:
            where = self.cmpl_serving.enclosing(self.cmpl_serving.line("np.save(buf, output.routed_experts)"))
            block, line = self.cmpl_serving.if_block(
                where, "output.routed_experts is not None", "np.save(buf, output.routed_experts)"
            )

            def inline(array: npt.NDArray[Any]) -> str:
                ns = run_source(
                    block,
                    namespace(output=types.SimpleNamespace(routed_experts=array), routed_experts_b64=None),
                    f"<vllm {version} serving inline>",
                )
                return str(ns["routed_experts_b64"])

            self.encode = inline
            fx.use(
                self.cmpl_serving,
                [where],
                "Executed: the inline `if output.routed_experts is not None:` block (np.save + pybase64 b64encode).",
                {"inline_np_save": line},
            )
            fx.fact(
                self.cmpl_serving,
                line,
                "encoding inline in serving.py: base64(np.save(array)) (pybase64 imported as base64)",
            )
        if version == "0.33.0":
            expr, line = capturer.expression("RoutedExpertsCapturer.__init__", "self.output_dtype_name")
            self.dtype_of: Callable[[int], np.dtype[Any]] = lambda e: np.dtype(eval(expr, {"num_experts": e}))
            axis_line = capturer.line("num_layers = model_config.get_total_num_hidden_layers()")
        else:
            expr, line = capturer.expression("RoutedExpertsManager.__init__", "expert_id_dtype")
            self.dtype_of = lambda e: np.dtype(eval(expr, {"num_experts": e, "np": np}))
            axis_line = (
                capturer.line("num_layers = model_config.get_total_num_hidden_layers()")
                if "get_total_num_hidden_layers()" in capturer.text
                else capturer.line("hf_config.num_hidden_layers,", after="self.routed_experts_by_slot = np.zeros")
            )
        fx.use(
            capturer,
            ["dtype rule", "layer axis"],
            f"Executed: `{expr}`; buffers sized by the total hidden layer count (full axis).",
            {"dtype": line, "axis": axis_line},
        )
        fx.fact(capturer, line, f"dtype: `{expr}` (uint8 if E <= 256 else uint16)")
        fx.fact(capturer, axis_line, "layer axis: total num_hidden_layers (full axis, dense layers 0)")
        router = wheel.read("vllm/model_executor/layers/fused_moe/router/base_router.py")
        cap = router.line("# Capture logical ids before EPLB mapping.")
        fx.use(router, ["BaseRouter.select_experts"], "capture before EPLB mapping: logical IDs.", {"capture": cap})
        fx.fact(router, cap, "capture_fn before `_apply_eplb_mapping`: **logical** IDs")

    def rows(self, ids_moe: IntArray, spec: Spec, start: int) -> npt.NDArray[Any]:
        """Rows [start, n - 1) on the full axis in the version's dtype (prefix hits filled: KV-slot / block store)."""
        n = ids_moe.shape[0]
        return full_axis(ids_moe, spec)[start : n - 1].astype(self.dtype_of(spec.num_experts))

    def b64(self, ids_moe: IntArray, spec: Spec, start: int) -> str:
        text = self.encode(self.rows(ids_moe, spec, start))
        back = b64_npy_load(text)
        assert back.dtype == self.dtype_of(spec.num_experts)
        return text


def _completions_022plus(
    ctx: Ctx, version: str, name: str, spec: Spec, *, start: int | None, n_choices: int, description: str
) -> Fixture:
    fx = Fixture(name, "vllm", version, spec, description)
    v = _V022Plus(ctx, fx, version)
    proto = v.cmpl_proto
    fx.use(
        proto,
        ["CompletionResponse", "CompletionResponseChoice", "CompletionRequest"],
        "Field names.",
        {"choice.routed_experts": proto.line("routed_experts: str | None = None")},
    )
    fx.fact(
        proto,
        proto.line("routed_experts: str | None = None"),
        "`CompletionResponseChoice.routed_experts: "
        "str | None` (base64 .npy); `prompt_token_ids`/`token_ids` per choice with `return_token_ids`",
    )
    if "routed_experts_prompt_start" in proto.text:
        req_line = proto.line("routed_experts_prompt_start: int = Field(")
        fx.fact(
            proto,
            req_line,
            "request field `routed_experts_prompt_start` (top level of the /v1/completions "
            "body, ge=0), passed to SamplingParams",
        )
    else:
        fx.fact(
            proto,
            None,
            "no `routed_experts_prompt_start` request field in this version (SamplingParams only:"
            " reachable in-process or via /inference/v1/generate `sampling_params`)",
        )
    rng = rng_for(name)
    p = 9
    prompt = tokens(rng, p)
    request: dict[str, Any] = {
        "model": spec.name,
        "prompt": prompt.tolist(),
        "max_tokens": 6,
        "n": n_choices,
        "return_token_ids": True,
    }
    if start is not None:
        assert "routed_experts_prompt_start" in proto.text
        request["routed_experts_prompt_start"] = start
    s = start or 0
    ids_prompt = routes(rng, p, spec)  # n > 1: each child request recomputes / prefix-hits the same prompt rows
    choices = []
    total = 0
    for i in range(n_choices):
        r = 4 + 2 * i
        out = tokens(rng, r)
        toks = np.concatenate([prompt, out])
        ids = np.concatenate([ids_prompt, routes(rng, r, spec)])
        choices.append(
            dump_model(
                proto,
                "CompletionResponseChoice",
                {
                    "index": i,
                    "text": f"<detokenized {r} tokens>",
                    "finish_reason": "length" if i == 0 else "stop",
                    "prompt_token_ids": prompt.tolist(),
                    "token_ids": out.tolist(),
                    "routed_experts": v.b64(ids, spec, s),
                },
            )
        )
        fx.add(f"cmpl-{version}/{i}", ids, span(p + r, s, p + r - 1), toks)
        total += r
    fx.payload["request.json"] = request
    fx.payload["response.json"] = dump_model(
        proto,
        "CompletionResponse",
        {
            "id": f"cmpl-{version}",
            "object": "text_completion",
            "created": 1767225600,
            "model": spec.name,
            "choices": choices,
            "usage": {
                "prompt_tokens": p,
                "total_tokens": p + total,
                "completion_tokens": total,
                "prompt_tokens_details": None,
            },
        },
    )
    fx.files = {"request.json": "/v1/completions request", "response.json": f"CompletionResponse (vLLM {version})"}
    if start:
        fx.notes = {str(i): {"start": s} for i in range(n_choices)}
    return fx


@builder("vllm-0.22.0-completions")
def vllm_022_completions(ctx: Ctx) -> Fixture:
    return _completions_022plus(
        ctx,
        "0.22.0",
        "vllm-0.22.0-completions",
        DEEPSEEK,
        start=None,
        n_choices=2,
        description="vLLM 0.22.0 /v1/completions, n=2: each choice carries its own rows [0, n_tokens - 1) as base64 "
        ".npy (inline np.save in serving.py), uint8, full decoder axis (dense layers 0); no request-level "
        "routed_experts_prompt_start yet.",
    )


@builder("vllm-0.28.0-completions-promptstart")
def vllm_028_completions(ctx: Ctx) -> Fixture:
    return _completions_022plus(
        ctx,
        "0.28.0",
        "vllm-0.28.0-completions-promptstart",
        DEEPSEEK,
        start=5,
        n_choices=2,
        description="vLLM 0.28.0 /v1/completions, n=2, request field routed_experts_prompt_start=5 (first version "
        "with the request field and numpy2base64): rows [5, n_tokens - 1) per choice, uint8, full axis.",
    )


@builder("vllm-0.33.0-completions-e300")
def vllm_033_completions(ctx: Ctx) -> Fixture:
    return _completions_022plus(
        ctx,
        "0.33.0",
        "vllm-0.33.0-completions-e300",
        WIDE,
        start=None,
        n_choices=1,
        description="vLLM 0.33.0 /v1/completions for a 300-expert model: uint16 .npy (numpy2base64), full axis.",
    )


def _chat_022plus(
    ctx: Ctx, version: str, name: str, spec: Spec, *, start: int | None, cached: int, description: str
) -> Fixture:
    fx = Fixture(name, "vllm", version, spec, description)
    v = _V022Plus(ctx, fx, version)
    proto, serving = v.chat_proto, v.chat_serving
    fx.use(
        proto,
        ["ChatCompletionResponse", "ChatCompletionResponseChoice", "ChatCompletionRequest"],
        "Field names (prompt_token_ids is response-level in chat, token_ids per choice).",
        {"choice.routed_experts": proto.line("routed_experts: str | None = None")},
    )
    where, pt_line = serving.named("prompt_token_ids=", after="routed_experts")
    fx.use(
        serving, [where], "sets response prompt_token_ids and choices' routed_experts.", {"prompt_token_ids": pt_line}
    )
    fx.fact(
        proto,
        proto.line("routed_experts: str | None = None"),
        "`ChatCompletionResponseChoice.routed_experts:"
        " str | None`; chat has response-level `prompt_token_ids` and per-choice `token_ids`",
    )
    rng = rng_for(name)
    p, r = 14, 5
    toks = tokens(rng, p + r)
    ids = routes(rng, p + r, spec)
    s = start or 0
    request: dict[str, Any] = {
        "model": spec.name,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": r,
        "return_token_ids": True,
    }
    if start is not None:
        request["routed_experts_prompt_start"] = start
        fx.fact(
            proto,
            proto.line("routed_experts_prompt_start: int = Field("),
            "chat request field `routed_experts_prompt_start` (top level)",
        )
    choice = dump_model(
        proto,
        "ChatCompletionResponseChoice",
        {
            "index": 0,
            "message": dump_model(
                proto, "ChatMessage", {"role": "assistant", "content": "<detokenized>", "tool_calls": []}
            ),
            "finish_reason": "length",
            "token_ids": toks[p:].tolist(),
            "routed_experts": v.b64(ids, spec, s),
        },
    )
    fx.payload["request.json"] = request
    fx.payload["response.json"] = dump_model(
        proto,
        "ChatCompletionResponse",
        {
            "id": f"chatcmpl-{version}",
            "object": "chat.completion",
            "created": 1767225600,
            "model": spec.name,
            "choices": [choice],
            "usage": {
                "prompt_tokens": p,
                "total_tokens": p + r,
                "completion_tokens": r,
                "prompt_tokens_details": {"cached_tokens": cached} if cached else None,
            },
            "prompt_token_ids": toks[:p].tolist(),
        },
    )
    fx.add(f"chatcmpl-{version}", ids, span(p + r, s, p + r - 1), toks)
    fx.notes = {"0": {"start": s, "prefix_cached_tokens": cached, "prefix_rows": "filled"}} if (s or cached) else {}
    fx.files = {"request.json": "chat request", "response.json": f"ChatCompletionResponse (vLLM {version})"}
    return fx


@builder("vllm-0.28.0-chat")
def vllm_028_chat(ctx: Ctx) -> Fixture:
    return _chat_022plus(
        ctx,
        "0.28.0",
        "vllm-0.28.0-chat",
        QWEN,
        start=None,
        cached=0,
        description="vLLM 0.28.0 /v1/chat/completions: base64 .npy uint8 (numpy2base64), full axis "
        "(all-MoE model: full = MoE-only), rows [0, n_tokens - 1).",
    )


@builder("vllm-0.33.0-chat-promptstart")
def vllm_033_chat(ctx: Ctx) -> Fixture:
    return _chat_022plus(
        ctx,
        "0.33.0",
        "vllm-0.33.0-chat-promptstart",
        DEEPSEEK,
        start=6,
        cached=8,
        description="vLLM 0.33.0 /v1/chat/completions with routed_experts_prompt_start=6 and an "
        "8-token prefix-cache hit (rows restored from the block store: filled): rows [6, n - 1).",
    )


# ---- vLLM /inference/v1/generate ----
def _generate_files(wheel: Wheel) -> tuple[SourceFile, SourceFile]:
    for base in ("vllm/entrypoints/scale_out/token_in_token_out", "vllm/entrypoints/serve/disagg"):
        with zipfile.ZipFile(wheel.path) as archive:
            if f"{base}/protocol.py" in archive.namelist():
                return wheel.read(f"{base}/protocol.py"), wheel.read(f"{base}/serving.py")
    raise SystemExit(f"{wheel.label}: no generate protocol")


def _generate(ctx: Ctx, version: str, name: str, *, stream: bool, abort: bool, start: int) -> Fixture:
    spec = DEEPSEEK
    fx = Fixture(name, "vllm", version, spec, "")
    v = _V022Plus(ctx, fx, version)
    proto, serving = _generate_files(v.wheel)
    new = version == "0.33.0"
    resp_cls = "GenerateTokensResponse" if new else "GenerateResponse"
    choice_cls = "GenerateTokensChoice" if new else "GenerateResponseChoice"
    stream_cls = "GenerateTokensStreamResponse" if new else "GenerateStreamResponse"
    stream_choice_cls = "GenerateTokensStreamChoice" if new else "GenerateResponseStreamChoice"
    fx.use(
        proto,
        ["GenerateRequest", resp_cls, choice_cls, stream_cls, stream_choice_cls],
        "Field names.",
        {
            "request.sampling_params": proto.line("sampling_params: SamplingParams"),
            "choice.routed_experts": proto.line("routed_experts: str | None = None"),
        },
    )
    fx.fact(
        proto,
        proto.line("sampling_params: SamplingParams"),
        "request `{token_ids, sampling_params: "
        "SamplingParams}`: `routed_experts_prompt_start` is nested under `sampling_params`",
    )
    stream_fields = proto.fields(stream_choice_cls)
    fx.fact(proto, proto.line(f"class {stream_choice_cls}"), f"stream choice fields {stream_fields}")
    rng = rng_for(name)
    p, r = 8, 5
    k = 3 if abort else r  # tokens produced before the abort
    toks = tokens(rng, p + r)[: p + k]
    ids = routes(rng, p + k, spec)
    request: dict[str, Any] = {
        "token_ids": toks[:p].tolist(),
        "sampling_params": {"max_tokens": r, "temperature": 1.0},
        "stream": stream,
    }
    if start:
        request["sampling_params"]["routed_experts_prompt_start"] = start
    if new:
        request["return_token_ids"] = True
    fx.payload["request.json"] = request
    b64 = v.encode(v.rows(ids, spec, start))
    finish = "abort" if abort else "length"
    if not stream:
        choice = {"index": 0, "finish_reason": finish, "token_ids": toks[p:].tolist(), "routed_experts": b64}
        if new:
            choice["stop_reason"] = None
        resp: dict[str, Any] = {"request_id": f"gen-{version}", "choices": [dump_model(proto, choice_cls, choice)]}
        if new:
            resp |= {
                "prompt_token_ids": toks[:p].tolist(),
                "output_mode": "tokens",
                "usage": {
                    "prompt_tokens": p,
                    "total_tokens": p + k,
                    "completion_tokens": k,
                    "prompt_tokens_details": None,
                },
            }
        fx.payload["response.json"] = dump_model(proto, resp_cls, resp)
        fx.files = {"request.json": "/inference/v1/generate request", "response.json": f"{resp_cls} (non-streamed)"}
    else:
        chunks = []
        for j in range(k):
            last = j == k - 1
            choice = {
                "index": 0,
                "finish_reason": finish if last else None,
                "token_ids": [int(toks[p + j])],
                "routed_experts": b64 if last else None,
            }
            if new:
                choice["stop_reason"] = None
            chunk: dict[str, Any] = {
                "request_id": f"gen-{version}",
                "choices": [dump_model(proto, stream_choice_cls, choice)],
            }
            if new:
                chunk["output_mode"] = "tokens"
                if j == 0:
                    chunk["prompt_token_ids"] = toks[:p].tolist()
            chunks.append(dump_model(proto, stream_cls, chunk))
        fx.payload["stream.jsonl"] = chunks
        fx.files = {
            "request.json": "/inference/v1/generate request (stream: true)",
            "stream.jsonl": "every SSE `data:` chunk's JSON, in order (the terminating `data: [DONE]` line "
            "is not a JSON object and is left out); routing only on the final chunk, whose token_ids is the "
            "last delta",
        }
        concat = serving.line("routed_experts=routed_experts_b64,", after="async def serve_tokens_stream_generator")
        fx.fact(
            serving,
            concat,
            "streamed chunks: `routed_experts` set from `output.routed_experts`, which the "
            "output processor fills only on the finished output (chunks concatenated on finish)",
        )
    where, gen_line = serving.named("routed_experts=routed_experts_b64,", after="async def serve_tokens_full_generator")
    fx.use(
        serving,
        [where, "ServingTokens.serve_tokens_stream_generator"],
        "choice construction (non-streamed and streamed).",
        {"full_routed_experts": gen_line},
    )
    outproc = v.wheel.read("vllm/v1/engine/output_processor.py")
    where, fin = outproc.named("if finished and self.routed_experts_chunks:")
    fx.use(
        outproc,
        [where],
        "routed_experts = concat of per-step chunks, only on the finished output (also for aborts).",
        {"concat_on_finish": fin},
    )
    fx.fact(
        outproc,
        fin,
        "`routed_experts = np.concatenate(routed_experts_chunks)` only when finished; an abort "
        "after some steps is a finished output too -> partial rows [start, prompt + k - 1), finish_reason 'abort'",
    )
    fx.add(f"gen-{version}", ids, span(p + k, start, p + k - 1), toks)
    fx.notes = {"0": {"start": start}} if start else {}
    if abort:
        fx.notes["0"] = {
            "start": start,
            "aborted_after_tokens": k,
            "why": "abort is a finished output: chunks so far are concatenated",
        }
    kind = "streamed" if stream else "non-streamed"
    fx.description = (
        f"vLLM {version} /inference/v1/generate ({kind}{', aborted' if abort else ''}): token-in "
        f"request with sampling_params.routed_experts_prompt_start={start}; choices[0].routed_experts "
        "base64 .npy uint8 full axis, rows [start, n_tokens - 1)."
    )
    return fx


@builder("vllm-0.22.0-generate")
def vllm_022_generate(ctx: Ctx) -> Fixture:
    return _generate(ctx, "0.22.0", "vllm-0.22.0-generate", stream=False, abort=False, start=3)


@builder("vllm-0.24.0-generate-stream")
def vllm_024_stream(ctx: Ctx) -> Fixture:
    return _generate(ctx, "0.24.0", "vllm-0.24.0-generate-stream", stream=True, abort=False, start=0)


@builder("vllm-0.33.0-generate")
def vllm_033_generate(ctx: Ctx) -> Fixture:
    return _generate(ctx, "0.33.0", "vllm-0.33.0-generate", stream=False, abort=False, start=3)


@builder("vllm-0.33.0-generate-stream")
def vllm_033_stream(ctx: Ctx) -> Fixture:
    return _generate(ctx, "0.33.0", "vllm-0.33.0-generate-stream", stream=True, abort=False, start=0)


@builder("vllm-0.33.0-generate-abort")
def vllm_033_abort(ctx: Ctx) -> Fixture:
    return _generate(ctx, "0.33.0", "vllm-0.33.0-generate-abort", stream=False, abort=True, start=0)


# ---- SGLang ----
class _SGLang:
    def __init__(self, ctx: Ctx, fx: Fixture, version: str) -> None:
        wheel = ctx.wheel("sglang", version)
        self.version = version
        self.wheel = wheel
        self.fx = fx
        self.detok = wheel.read("sglang/srt/managers/detokenizer_manager.py")
        self.tm = wheel.read("sglang/srt/managers/tokenizer_manager.py")
        self.batch = wheel.read("sglang/srt/managers/schedule_batch.py")
        self.io = wheel.read("sglang/srt/managers/io_struct.py")
        ns: dict[str, Any] = namespace(Union=Any, List=list, Optional=Any)
        for cls in ("BaseFinishReason", "FINISH_MATCHED_TOKEN", "FINISH_LENGTH", "FINISH_ABORT"):
            run_source(self.batch.definition(cls), ns, f"<sglang {version} {cls}>")
        self.finish = ns
        fx.use(
            self.batch,
            ["BaseFinishReason", "FINISH_MATCHED_TOKEN", "FINISH_LENGTH", "FINISH_ABORT"],
            "Executed: finish_reason.to_json() dicts.",
            {"FINISH_ABORT": self.batch.line("class FINISH_ABORT")},
        )
        if "_b64_encode_per_request" in self.detok.text:
            fn = load_def(self.detok, "DetokenizerManager._b64_encode_per_request")
            self._encode: Callable[[list[Any]], list[Any]] = fn
            line = self.detok.line("def _b64_encode_per_request")
            names = ["DetokenizerManager._b64_encode_per_request"]
        else:
            method = load_def(self.detok, "DetokenizerManager._extract_routed_experts")
            self._encode = lambda items: method(None, types.SimpleNamespace(routed_experts=items))
            line = self.detok.line("def _extract_routed_experts")
            names = ["DetokenizerManager._extract_routed_experts"]
        fx.use(
            self.detok,
            names,
            "Executed: base64 of the raw int32 tensor bytes (pybase64 -> base64, same bytes), "
            "per request in the batch.",
            {"encode": line},
        )
        fx.fact(
            self.detok,
            line,
            f"`{names[0].split('.')[-1]}`: base64(tensor.numpy().tobytes()) -> flat raw "
            "little-endian int32, no shape header; a request without routing becomes "
            + ("None" if "_b64_encode_per_request" in names[0] else "`[]` (empty list)"),
        )
        meta_line = self.tm.line('meta_info["routed_experts"] = ')
        fx.use(
            self.tm,
            ["TokenizerManager._handle_batch_output"],
            "meta_info keys and where routed_experts goes.",
            {"meta_info.routed_experts": meta_line},
        )
        fx.fact(self.tm, meta_line, '`meta_info["routed_experts"]` set when the batch output has routing')
        self.retractions = "num_retractions" if '"num_retractions"' in self.tm.text else "total_retractions"
        self.tm.line(f'"{self.retractions}"')
        req_line = self.io.line("return_routed_experts: bool = False")
        fx.use(self.io, ["GenerateReqInput"], "request fields.", {"return_routed_experts": req_line})
        self.has_start_len = "routed_experts_start_len" in self.io.text
        start_used = False
        for path in (
            "sglang/srt/managers/scheduler_output_processor_mixin.py",
            "sglang/srt/managers/scheduler_components/batch_result_processor.py",
        ):
            with zipfile.ZipFile(wheel.path) as archive:
                if path in archive.namelist():
                    src = wheel.read(path)
                    if "start_len=start_len" in src.text:
                        start_used = True
                        ln = src.line("start_len=start_len")
                        fx.use(
                            src,
                            ["_maybe_collect_routed_experts / maybe_collect_routed_experts"],
                            "get_topk(..., start_len) -> rows [start_len, seqlen - 1).",
                            {"get_topk": ln},
                        )
                        fx.fact(src, ln, "rows [routed_experts_start_len, seqlen - 1) (start_len honoured)")
                    elif "def maybe_collect_routed_experts" in src.text:
                        ln = src.line("seqlen=req.seqlen,", after="def maybe_collect_routed_experts")
                        fx.use(
                            src,
                            ["SchedulerOutputProcessorMixin.maybe_collect_routed_experts"],
                            "get_routed_experts(req_pool_idx, seqlen) with no start: rows [0, seqlen - 1).",
                            {"get_routed_experts": ln},
                        )
                        fx.fact(
                            src,
                            ln,
                            "rows [0, seqlen - 1): the capturer reads req_to_token[:seqlen - 1] "
                            "(KV slots: radix-cache hits filled); no start offset",
                        )
        self.start_len_honoured = start_used
        if self.has_start_len:
            ln = self.io.line("routed_experts_start_len: int = 0")
            fx.fact(
                self.io,
                ln,
                "`GenerateReqInput.routed_experts_start_len` declared"
                + ("" if start_used else " but NEVER read by the scheduler in this version (silently ignored)"),
            )

    def encode(self, rows: npt.NDArray[np.int32] | None) -> Any:
        return self._encode([None if rows is None else TensorLike(rows)])[0]

    def finish_json(self, kind: str, value: Any = None) -> dict[str, Any]:
        if kind == "length":
            return dict(self.finish["FINISH_LENGTH"](value).to_json())
        if kind == "token":
            return dict(self.finish["FINISH_MATCHED_TOKEN"](value).to_json())
        return dict(self.finish["FINISH_ABORT"]().to_json())

    def meta(self, rid: str, finish: dict[str, Any], p: int, r: int, cached: int, routed: Any) -> dict[str, Any]:
        """meta_info in the key order TokenizerManager builds it (metrics off)."""
        meta: dict[str, Any] = {
            "id": rid,
            "finish_reason": finish,
            "prompt_tokens": p,
            "weight_version": "default",
            self.retractions: 0,
            "completion_tokens": r,
            "cached_tokens": cached,
        }
        if routed is not None:
            meta["routed_experts"] = routed
        meta["e2e_latency"] = 0.5
        return meta


def _sgl_rows(ids: IntArray, spec: Spec, start: int) -> npt.NDArray[np.int32]:
    n = ids.shape[0]
    return full_axis(ids, spec)[start : n - 1].astype(np.int32)


@builder("sglang-0.5.8-generate")
def sglang_058_generate(ctx: Ctx) -> Fixture:
    name = "sglang-0.5.8-generate"
    spec = DEEPSEEK
    fx = Fixture(
        name,
        "sglang",
        "0.5.8",
        spec,
        "SGLang 0.5.8 batched /generate (two input_ids lists): a list of "
        "two responses, meta_info.routed_experts = base64 of raw int32, full decoder axis, rows [0, n - 1); "
        "the second prompt shares a 6-token radix-cache prefix (rows filled).",
    )
    sg = _SGLang(ctx, fx, "0.5.8")
    rng = rng_for(name)
    shared = 6
    base = tokens(rng, 20)
    base_ids = routes(rng, 20, spec)
    responses, inputs = [], []
    for i, (p, r, finish) in enumerate(((9, 5, "length"), (10, 4, "token"))):
        toks = np.concatenate([base[:shared], tokens(rng, p + r - shared)]) if i else base[: p + r]
        ids = np.concatenate([base_ids[:shared], routes(rng, p + r - shared, spec)]) if i else base_ids[: p + r]
        inputs.append(toks[:p].tolist())
        fin = sg.finish_json(finish, r if finish == "length" else int(toks[-1]))
        meta = sg.meta(f"sgl-058-{i}", fin, p, r, shared if i else 0, sg.encode(_sgl_rows(ids, spec, 0)))
        responses.append({"text": "<detokenized>", "output_ids": toks[p:].tolist(), "meta_info": meta})
        fx.add(f"sgl-058-{i}", ids, span(p + r, 0, p + r - 1), toks)
    fx.payload["request.json"] = {
        "input_ids": inputs,
        "sampling_params": {"max_new_tokens": 5, "temperature": 1.0},
        "return_routed_experts": True,
    }
    fx.payload["responses.json"] = responses
    fx.files = {"request.json": "batched /generate request", "responses.json": "the list /generate returns"}
    return fx


def _sglang_turns(ctx: Ctx, version: str, name: str) -> Fixture:
    spec = DEEPSEEK
    fx = Fixture(name, "sglang", version, spec, "")
    sg = _SGLang(ctx, fx, version)
    rng = rng_for(name)
    p1, r1, u, r2 = 8, 4, 5, 4
    t1 = p1 + r1
    p2 = t1 + u
    toks = tokens(rng, p2 + r2)
    ids = routes(rng, p2 + r2, spec)
    start = t1 - 1  # miles: routed_experts_start_len = len(checkpoint_tokens) - 1 (the row turn 1 never returned)
    requests, responses = [], []
    for turn, (p, r, s_req) in enumerate(((p1, r1, 0), (p2, r2, start))):
        n = p + r
        s_eff = s_req if sg.start_len_honoured else 0
        req: dict[str, Any] = {
            "input_ids": toks[:p].tolist(),
            "sampling_params": {"max_new_tokens": r},
            "return_routed_experts": True,
        }
        if s_req:
            req["routed_experts_start_len"] = s_req
        requests.append(req)
        fin = sg.finish_json("length", r)
        meta = sg.meta(f"sgl-turn{turn}", fin, p, r, t1 if turn else 0, sg.encode(_sgl_rows(ids[:n], spec, s_eff)))
        responses.append({"text": "<detokenized>", "output_ids": toks[p:n].tolist(), "meta_info": meta})
        fx.add(f"session/turn{turn}", ids[:n], span(n, s_eff, n - 1), toks[:n])
    fx.payload["requests.json"] = requests
    fx.payload["responses.json"] = responses
    fx.files = {
        "requests.json": "the two /generate requests of one session (turn 1 resends turn 0's tokens + new "
        "user tokens, with routed_experts_start_len = len(turn-0 tokens) - 1)",
        "responses.json": "the two /generate responses",
    }
    if sg.start_len_honoured:
        fx.add("session/stitched", ids, span(p2 + r2, 0, p2 + r2 - 1), toks)
        fx.notes = {"1": {"start": start}, "2": {"stitched": "turn 0 rows [0, start) + turn 1 rows [start, n - 1)"}}
        fx.description = (
            f"SGLang {version} multi-turn /generate: turn 1 sends routed_experts_start_len={start} and "
            "gets rows [start, n - 1) only (int32 base64, full axis); sample 2 is the stitched session."
        )
    else:
        fx.notes = {
            "1": {
                "start_len_sent": start,
                "start_len_ignored": True,
                "why": "declared in GenerateReqInput but never passed to the capturer: rows [0, n - 1)",
            }
        }
        fx.description = (
            f"SGLang {version} multi-turn /generate: turn 1 sends routed_experts_start_len={start}, but "
            "this version ignores the field and returns ALL rows [0, n - 1) (radix hits filled)."
        )
    return fx


@builder("sglang-0.5.8-generate-startlen-ignored")
def sglang_058_turns(ctx: Ctx) -> Fixture:
    return _sglang_turns(ctx, "0.5.8", "sglang-0.5.8-generate-startlen-ignored")


@builder("sglang-0.5.12-generate-multiturn")
def sglang_0512_turns(ctx: Ctx) -> Fixture:
    return _sglang_turns(ctx, "0.5.12", "sglang-0.5.12-generate-multiturn")


@builder("sglang-0.5.9-completions")
def sglang_059_completions(ctx: Ctx) -> Fixture:
    name = "sglang-0.5.9-completions"
    spec = QWEN
    fx = Fixture(
        name,
        "sglang",
        "0.5.9",
        spec,
        "SGLang 0.5.9 OpenAI /v1/completions with n=2: response-level "
        "sglext.routed_experts (base64 raw int32) built from the FIRST result only; choice 1's routing is "
        "absent; choices carry no token ids.",
    )
    sg = _SGLang(ctx, fx, "0.5.9")
    wheel = sg.wheel
    proto = wheel.read("sglang/srt/entrypoints/openai/protocol.py")
    serving = wheel.read("sglang/srt/entrypoints/openai/serving_completions.py")
    utils = wheel.read("sglang/srt/entrypoints/openai/utils.py")
    pick = load_def(utils, "process_routed_experts_from_ret")
    where, first = serving.named("routed_experts = process_routed_experts_from_ret(first_ret, request)")
    fx.use(
        utils,
        ["process_routed_experts_from_ret"],
        "Executed: meta_info['routed_experts'] of one ret item.",
        {"def": utils.line("def process_routed_experts_from_ret")},
    )
    fx.use(serving, [where], "sglext from ret[0] only.", {"first_ret": first})
    fx.use(
        proto,
        ["SglExt", "CompletionResponse", "CompletionResponseChoice", "CompletionRequest"],
        "Field names and None-dropping serializers.",
        {"SglExt": proto.line("class SglExt")},
    )
    fx.fact(
        serving,
        first,
        "OpenAI completions/chat: `sglext.routed_experts` (response level, key `sglext`) from "
        "the FIRST ret item only; other choices/prompts get no routing",
    )
    fx.fact(
        proto, proto.line("class SglExt"), "`SglExt` serializer drops None fields; responses drop `sglext` when None"
    )
    rng = rng_for(name)
    p = 7
    prompt = tokens(rng, p)
    ids_prompt = routes(rng, p, spec)
    rets, choices = [], []
    for i, r in enumerate((4, 6)):
        out = tokens(rng, r)
        toks = np.concatenate([prompt, out])
        ids = np.concatenate([ids_prompt, routes(rng, r, spec)])
        fin = sg.finish_json("length", r)
        rets.append(
            {"meta_info": sg.meta(f"sgl-cmpl-{i}", fin, p, r, p if i else 0, sg.encode(_sgl_rows(ids, spec, 0)))}
        )
        choices.append(
            dump_model(
                proto,
                "CompletionResponseChoice",
                {"index": i, "text": "<detokenized>", "finish_reason": "length", "matched_stop": None},
                drop_none=proto.popped_when_none("CompletionResponseChoice"),
            )
        )
        fx.add(f"sgl-cmpl/{i}", ids, span(p + r, 0, p + r - 1) if i == 0 else np.zeros(p + r, bool), toks)
    request = types.SimpleNamespace(return_routed_experts=True)
    sglext = {
        k: v
        for k, v in {"routed_experts": pick(rets[0], request), "cached_tokens_details": None}.items()
        if v is not None
    }
    fx.payload["request.json"] = {
        "model": spec.name,
        "prompt": prompt.tolist(),
        "max_tokens": 6,
        "n": 2,
        "return_routed_experts": True,
    }
    fx.payload["response.json"] = dump_model(
        proto,
        "CompletionResponse",
        {
            "id": "sgl-cmpl",
            "object": "text_completion",
            "created": 1767225600,
            "model": spec.name,
            "choices": choices,
            "usage": dump_model(
                proto,
                "UsageInfo",
                {"prompt_tokens": p, "total_tokens": p + 10, "completion_tokens": 10, "reasoning_tokens": 0},
            ),
            "metadata": None,
            "sglext": sglext,
        },
        drop_none=proto.popped_when_none("CompletionResponse"),
    )
    fx.notes = {
        "1": {"routing_absent": True, "why": "sglext.routed_experts comes from ret[0] only"},
        "token_ids": "the response has no token ids: prompt from the request, output lengths only from "
        "the routing row count (choice 0) / usage",
    }
    fx.files = {"request.json": "/v1/completions request (n=2)", "response.json": "CompletionResponse (SGLang 0.5.9)"}
    return fx


@builder("sglang-0.5.23-chat-metainfo")
def sglang_0523_chat(ctx: Ctx) -> Fixture:
    name = "sglang-0.5.23-chat-metainfo"
    spec = DEEPSEEK
    fx = Fixture(
        name,
        "sglang",
        "0.5.23",
        spec,
        "SGLang 0.5.23 /v1/chat/completions with return_meta_info and "
        "return_token_ids: routing in choices[i].meta_info.routed_experts (per choice, base64 int32), "
        "sglext.routed_experts suppressed; choices carry prompt_token_ids and response_token_ids.",
    )
    sg = _SGLang(ctx, fx, "0.5.23")
    wheel = sg.wheel
    proto = wheel.read("sglang/srt/entrypoints/openai/protocol.py")
    serving = wheel.read("sglang/srt/entrypoints/openai/serving_chat.py")
    where, meta_line = serving.named('ret_item["meta_info"] if request.return_meta_info else None')
    none_line = serving.line("if request.return_meta_info", after="first_ret = ret[0]")
    fx.use(
        serving,
        [where],
        "meta_info per choice when return_meta_info; "
        "sglext.routed_experts None then; prompt_token_ids / response_token_ids with return_token_ids.",
        {
            "choice.meta_info": meta_line,
            "sglext_suppressed": none_line,
            "response_token_ids": serving.line('ret_item["output_ids"] if request.return_token_ids else None'),
        },
    )
    fx.use(
        proto,
        ["ChatCompletionResponseChoice", "ChatCompletionResponse", "ChatCompletionRequest"],
        "Field names and None-dropping serializers.",
        {
            "response_token_ids": proto.line("response_token_ids: Optional[List[int]] = None"),
            "return_meta_info": proto.line("return_meta_info: bool = False"),
        },
    )
    fx.fact(
        serving,
        meta_line,
        "chat with `return_meta_info`: `choices[i].meta_info` = the /generate meta_info "
        "(routed_experts inside, per choice); `sglext.routed_experts` is None (line "
        f"{none_line}); `choices[i].prompt_token_ids`, `choices[i].response_token_ids` need return_token_ids",
    )
    rng = rng_for(name)
    p = 10
    prompt = tokens(rng, p)
    ids_prompt = routes(rng, p, spec)
    choices = []
    for i, r in enumerate((5, 3)):
        out = tokens(rng, r)
        toks = np.concatenate([prompt, out])
        ids = np.concatenate([ids_prompt, routes(rng, r, spec)])
        fin = sg.finish_json("length", r)
        meta = sg.meta(f"sgl-chat-{i}", fin, p, r, p if i else 0, sg.encode(_sgl_rows(ids, spec, 0)))
        choices.append(
            dump_model(
                proto,
                "ChatCompletionResponseChoice",
                {
                    "index": i,
                    "message": dump_model(
                        proto,
                        "ChatMessage",
                        {"role": "assistant", "content": "<detokenized>"},
                        drop_none=proto.popped_when_none("ChatMessage"),
                    ),
                    "finish_reason": "length",
                    "matched_stop": None,
                    "prompt_token_ids": prompt.tolist(),
                    "response_token_ids": out.tolist(),
                    "meta_info": meta,
                },
                drop_none=proto.popped_when_none("ChatCompletionResponseChoice"),
            )
        )
        fx.add(f"sgl-chat/{i}", ids, span(p + r, 0, p + r - 1), toks)
    fx.payload["request.json"] = {
        "model": spec.name,
        "messages": [{"role": "user", "content": "hi"}],
        "n": 2,
        "max_tokens": 5,
        "return_routed_experts": True,
        "return_meta_info": True,
        "return_token_ids": True,
    }
    fx.payload["response.json"] = dump_model(
        proto,
        "ChatCompletionResponse",
        {
            "id": "sgl-chat",
            "object": "chat.completion",
            "created": 1767225600,
            "model": spec.name,
            "choices": choices,
            "usage": dump_model(
                proto,
                "UsageInfo",
                {"prompt_tokens": p, "total_tokens": p + 8, "completion_tokens": 8, "reasoning_tokens": 0},
            ),
            "metadata": None,
            "sglext": None,
        },
        drop_none=proto.popped_when_none("ChatCompletionResponse"),
    )
    fx.files = {"request.json": "chat request", "response.json": "ChatCompletionResponse (SGLang 0.5.23)"}
    return fx


@builder("sglang-0.5.23-generate-abort")
def sglang_0523_abort(ctx: Ctx) -> Fixture:
    name = "sglang-0.5.23-generate-abort"
    spec = DEEPSEEK
    fx = Fixture(
        name,
        "sglang",
        "0.5.23",
        spec,
        "SGLang 0.5.23 /generate aborts: [0] aborted while running "
        "(FINISH_ABORT -> finish_reason {type: abort, message: Aborted, ...}; routing collected like any "
        "finish, rows [0, n - 1)); [1] aborted in the waiting queue (no routed_experts key, no output).",
    )
    sg = _SGLang(ctx, fx, "0.5.23")
    where, q_line = sg.tm.named('abort_message = recv_obj.abort_message or "Abort in waiting queue"')
    fx.use(
        sg.tm, [where], "queued abort: meta_info {id, finish_reason, completion_tokens} only.", {"queued_abort": q_line}
    )
    fx.fact(
        sg.tm,
        q_line,
        "abort in the waiting queue: meta_info has id, finish_reason {type: abort, message: "
        "'Abort in waiting queue'}, completion_tokens; no routed_experts",
    )
    fx.fact(
        sg.batch,
        sg.batch.line("class FINISH_ABORT"),
        "running abort: `to_finish = FINISH_ABORT()` -> "
        "finish_reason {type: abort, message: Aborted, status_code: None, err_type: None}; finishes through "
        "the normal path, so routing is collected",
    )
    rng = rng_for(name)
    p, r = 8, 3
    toks = tokens(rng, p + r)
    ids = routes(rng, p + r, spec)
    running = {
        "text": "<partial>",
        "output_ids": toks[p:].tolist(),
        "meta_info": sg.meta("sgl-abort-0", sg.finish_json("abort"), p, r, 0, sg.encode(_sgl_rows(ids, spec, 0))),
    }
    fx.add("sgl-abort-0", ids, span(p + r, 0, p + r - 1), toks)
    q_toks = tokens(rng, 6)
    queued = {
        "text": "",
        "output_ids": [],
        "meta_info": {
            "id": "sgl-abort-1",
            "finish_reason": {"type": "abort", "message": "Abort in waiting queue"},
            "completion_tokens": 0,
        },
    }
    fx.add("sgl-abort-1", np.zeros((6, spec.n_moe, spec.topk), np.int64), np.zeros(6, bool), q_toks)
    fx.payload["responses.json"] = [running, queued]
    fx.notes = {"1": {"routing_absent": True, "why": "aborted before scheduling"}}
    fx.files = {"responses.json": "[0] running abort, [1] queued abort (/generate response objects)"}
    return fx


# ---- trainer-side layouts and forks ----
@builder("verl-0.9.1-batch")
def verl_batch(ctx: Ctx) -> Fixture:
    name = "verl-0.9.1-batch"
    spec = DEEPSEEK
    fx = Fixture(
        name,
        "verl",
        "0.9.1",
        spec,
        "veRL 0.9.1 agent-loop batch: routed_experts [B, prompt_length + "
        "response_length, L, K] int16, engine rows (vLLM 0.24 in-process: full axis, n - 1 rows) written "
        "from the left-padding offset; padding and the final token are zeros.",
    )
    wheel = ctx.wheel("verl", "0.9.1")
    loop = wheel.read("verl/experimental/agent_loop/agent_loop.py")
    lines = {
        "int16": loop.line("experts_tensor = experts_tensor.to(torch.int16)"),
        "zeros": loop.line("routed_experts = torch.zeros(1, total_length, layer_num, topk_num"),
        "start_pos": loop.line('start_pos = prompt_output["input_ids"].shape[1] - len(output.prompt_ids)'),
        "write": loop.line("routed_experts[:, start_pos:end_pos] = experts_tensor.unsqueeze(0)"),
        "left_pad": loop.line('padding_side="left"'),
        "concat": loop.line('optional_outputs["routed_experts"] = torch.cat('),
    }
    vsrv = wheel.read("verl/workers/rollout/vllm_rollout/vllm_async_server.py")
    vwhere, src_line = vsrv.named("routed_experts = final_res.outputs[0].routed_experts")
    fx.use(
        loop,
        sorted({loop.enclosing(lines["write"]), loop.enclosing(lines["concat"])}),
        "reproduced with "
        "numpy: cast to int16, zeros [1, P_max + R_max, L, K], rows written at [start_pos, start_pos + rows).",
        lines,
    )
    fx.use(vsrv, [vwhere], "routing = final_res.outputs[0].routed_experts (in-process).", {"outputs0": src_line})
    for key, text in (
        ("int16", "cast to int16"),
        (
            "start_pos",
            "start_pos = padded prompt length - prompt length "
            "(left padding); rows = engine rows (n - 1), so the last response token's row stays 0",
        ),
        ("concat", "batch tensor = cat over samples: [B, prompt_length + response_length, L, K]"),
    ):
        fx.fact(loop, lines[key], text)
    rng = rng_for(name)
    p_max, r_max = 12, 6
    batch_routes, mask, input_ids, response_mask = [], [], [], []
    for i, (p, r) in enumerate(((9, 6), (12, 3), (5, 5))):
        toks = tokens(rng, p + r)
        ids = routes(rng, p + r, spec)
        engine = full_axis(ids, spec)[: p + r - 1].astype(np.uint8)
        row = np.zeros((p_max + r_max, spec.num_layers, spec.topk), dtype=np.int16)
        start_pos = p_max - p
        row[start_pos : start_pos + engine.shape[0]] = engine.astype(np.int16)
        m = np.zeros(p_max + r_max, dtype=np.int64)
        m[start_pos : p_max + r] = 1
        ii = np.zeros(p_max + r_max, dtype=np.int64)
        ii[start_pos : p_max + r] = toks
        batch_routes.append(row)
        mask.append(m)
        input_ids.append(ii)
        rm = np.zeros(r_max, dtype=np.int64)
        rm[:r] = 1
        response_mask.append(rm)
        fx.add(f"verl/{i}", ids, span(p + r, 0, p + r - 1), toks)
    ids_arr = np.stack(input_ids)
    fx.payload["batch.npz"] = {
        "routed_experts": np.stack(batch_routes),
        "attention_mask": np.stack(mask),
        "input_ids": ids_arr,
        "prompts": ids_arr[:, :p_max],
        "responses": ids_arr[:, p_max:],
        "response_mask": np.stack(response_mask),
        "prompt_length": np.asarray(p_max),
    }
    fx.files = {
        "batch.npz": "routed_experts int16 [3, 18, 6, 4], attention_mask, input_ids, prompts, responses, "
        "response_mask, prompt_length (= rollout.prompt_length)"
    }
    return fx


@builder("slime-sample")
def slime_sample(ctx: Ctx) -> Fixture:
    name = "slime-sample"
    spec = DEEPSEEK
    fx = Fixture(
        name,
        "slime",
        "THUDM/slime main",
        spec,
        "slime Sample.rollout_routed_experts: int32 [len(tokens) - "
        "1, num_layers, moe_router_topk] (SGLang's full axis); sample 1 is multi-turn: the first "
        "start_len rows kept, the turn's new rows appended.",
    )
    fx.extra["reproduced_from"] = (
        "slime is not installable from PyPI (the name `slime` there is an unrelated 0.0.0 placeholder); reproduced "
        "from the public THUDM/slime source: slime/utils/types.py (Sample: `rollout_routed_experts`, "
        "`_apply_meta_info` -> decode_int32_meta_array(meta_info, 'routed_experts').reshape(len(tokens) - 1 - "
        "start_len, args.num_layers, args.moe_router_topk); with routed_experts_start_len > 0: "
        "cat(existing[:start_len], new)), slime/rollout/sglang_rollout.py (payload['return_routed_experts'] = True)"
    )
    fx.fact(
        "THUDM/slime `slime/utils/types.py`",
        None,
        "rows = len(tokens) - 1 (final token has none), int32, "
        "full axis (num_layers incl. dense); element count checked; multi-turn: existing[:start_len] ++ new",
    )
    rng = rng_for(name)
    arrays: dict[str, Any] = {}
    for sid, p, r in (("slime/0", 9, 5), ("slime/1", 14, 4)):
        toks = tokens(rng, p + r)
        ids = routes(rng, p + r, spec)
        rows = full_axis(ids, spec)[: p + r - 1].astype(np.int32)
        if sid == "slime/1":
            start = 10
            first_turn = rows[:start]  # from turn 1 (tokens[:11])
            new = rows[start:]  # turn 2 response with routed_experts_start_len=10
            rows = np.concatenate([first_turn[:start], new])
        arrays[f"{sid}/rollout_routed_experts"] = rows
        arrays[f"{sid}/tokens"] = toks
        arrays[f"{sid}/response_length"] = np.asarray(r)
        fx.add(sid, ids, span(p + r, 0, p + r - 1), toks)
    fx.payload["samples.npz"] = arrays
    fx.files = {
        "samples.npz": "<sample_id>/rollout_routed_experts (int32), <sample_id>/tokens, <sample_id>/response_length"
    }
    return fx


@builder("ms-swift-4.6.0-chat")
def ms_swift_chat(ctx: Ctx) -> Fixture:
    name = "ms-swift-4.6.0-chat"
    spec = DEEPSEEK
    fx = Fixture(
        name,
        "ms-swift",
        "4.6.0",
        spec,
        "ms-swift 4.6.0 rollout server chat response: choices[i]."
        "routed_experts = serialize_ndarray(vLLM CompletionOutput.routed_experts) = {data: base64 raw "
        "bytes, shape, dtype, __ndarray__: true}; with vLLM 0.23 (ms-swift's recommended version) that is "
        "uint8, full axis, rows [0, n - 1) INCLUDING the prompt rows.",
    )
    wheel = ctx.wheel("ms-swift", "4.6.0")
    proto = wheel.read("swift/infer_engine/protocol.py")
    engine = wheel.read("swift/infer_engine/grpo_vllm_engine.py")
    serialize = load_def(proto, "serialize_ndarray")
    fx.use(
        proto,
        ["serialize_ndarray", "ChatCompletionResponseChoice", "ChatCompletionResponse"],
        "Executed: serialize_ndarray; field names.",
        {
            "serialize_ndarray": proto.line("def serialize_ndarray"),
            "routed_experts": proto.line("routed_experts: Optional[NumpyArray]"),
        },
    )
    fx.use(
        engine,
        [engine.enclosing(engine.line("routed_experts=getattr(output, 'routed_experts', None))"))],
        "routed_experts = getattr(output, 'routed_experts', None) from vLLM.",
        {"getattr": engine.line("routed_experts=getattr(output, 'routed_experts', None))")},
    )
    fx.fact(
        proto,
        proto.line("def serialize_ndarray"),
        "`{'data': b64(arr.tobytes()), 'shape', 'dtype': "
        "str(dtype), '__ndarray__': True}` in `choices[i].routed_experts`",
    )
    fx.fact(
        engine,
        engine.line("routed_experts=getattr(output, 'routed_experts', None))"),
        "the array is vLLM's "
        "CompletionOutput.routed_experts as is: prompt rows included for vLLM >= 0.22 (generation rows only "
        "with 0.21, whose prompt rows live on RequestOutput and are dropped)",
    )
    v23 = ctx.wheel("vllm", "0.23.0").read("vllm/model_executor/layers/fused_moe/routed_experts_capturer.py")
    expr, line = v23.expression("RoutedExpertsManager.__init__", "expert_id_dtype")
    dtype = np.dtype(eval(expr, {"num_experts": spec.num_experts, "np": np}))
    fx.use(v23, ["RoutedExpertsManager.__init__"], f"vLLM 0.23.0 dtype rule `{expr}`.", {"dtype": line})
    rng = rng_for(name)
    p, r = 8, 5
    toks = tokens(rng, p + r)
    ids = routes(rng, p + r, spec)
    arr = full_axis(ids, spec)[: p + r - 1].astype(dtype)
    payload = serialize(arr)
    payload["shape"] = list(payload["shape"])
    choice = dump_model(
        proto,
        "ChatCompletionResponseChoice",
        {
            "index": 0,
            "message": {"role": "assistant", "content": "<detokenized>", "tool_calls": None, "reasoning_content": None},
            "finish_reason": "length",
            "logprobs": None,
            "token_ids": toks[p:].tolist(),
            "routed_experts": payload,
        },
    )
    resp_fields = proto.fields("ChatCompletionResponse")
    resp: dict[str, Any] = {
        "model": spec.name,
        "choices": [choice],
        "usage": {"prompt_tokens": p, "completion_tokens": r, "total_tokens": p + r},
    }
    for key, value in (
        ("id", "chatcmpl-swift"),
        ("object", "chat.completion"),
        ("created", 1767225600),
        ("prompt_token_ids", toks[:p].tolist()),
    ):
        if key in resp_fields:
            resp[key] = value
    fx.payload["response.json"] = dump_model(proto, "ChatCompletionResponse", resp)
    fx.add("chatcmpl-swift", ids, span(p + r, 0, p + r - 1), toks)
    fx.files = {"response.json": "ChatCompletionResponse dataclass as JSON (ms-swift 4.6.0)"}
    return fx


@builder("nemo-rl-chat")
def nemo_rl_chat(ctx: Ctx) -> Fixture:
    name = "nemo-rl-chat"
    spec = DEEPSEEK
    fx = Fixture(
        name,
        "nemo-rl",
        "NVIDIA-NeMo/RL main (vLLM 0.25.1)",
        spec,
        "NeMo-RL OpenAI chat server: "
        "choices[i].message.routed_experts = 'nrlre1:<dtype>:<S>x<L>x<K>:<base64>' over all S = n tokens "
        "(vLLM's axis); rows vLLM did not return are -1; the final row is the dummy arange(K). Response "
        "[1] had 3 rows missing (incomplete vLLM output).",
    )
    fx.extra["reproduced_from"] = (
        "nemo-rl on PyPI is a 0.0.0 placeholder without code; reproduced from the public NVIDIA-NeMo/RL source: "
        "nemo_rl/utils/routed_experts_codec.py encode_routed_experts (f'nrlre1:{dtype}:{S}x{L}x{K}:' + "
        "base64(C-contiguous bytes), dtypes int8/int16/int32); nemo_rl/models/generation/vllm/utils.py "
        "pad_and_align_routed_expert_indices (full = arange(K) for every row, rows [0, min(n - 1, returned)) copied, "
        "missing rows in [returned, n - 1) = R3_MISSING_ROUTE_SENTINEL) and "
        "attach_routed_experts_to_chat_response_choices (choice.message.routed_experts; prompt_token_ids, "
        "generation_token_ids, generation_log_probs on the message); nemo_rl/models/generation/interfaces.py "
        "(ROUTED_EXPERTS_MISSING_ROUTE_SENTINEL = -1; dtype int8 for <= 128 experts, int16 <= 32768, else int32)"
    )
    fx.fact(
        "NVIDIA-NeMo/RL `nemo_rl/models/generation/vllm/utils.py`",
        None,
        "S = prompt + generation tokens "
        "(T rows, not T - 1): final row dummy arange(K), missing rows -1; layer axis = vLLM's (full axis on "
        "0.22+, despite the docstring's num_moe_layers)",
    )
    vllm = _V022Plus(ctx, Fixture("scratch", "vllm", "0.25.1", spec, ""), "0.25.1")
    rng = rng_for(name)
    dtype = np.int8 if spec.num_experts <= 128 else np.int16
    responses = []
    for i, (p, r, missing) in enumerate(((7, 4, 0), (8, 5, 3))):
        toks = tokens(rng, p + r)
        ids = routes(rng, p + r, spec)
        n = p + r
        returned = vllm.rows(ids, spec, 0)[: n - 1 - missing]
        full = np.broadcast_to(np.arange(spec.topk), (n, spec.num_layers, spec.topk)).astype(dtype).copy()
        full[: returned.shape[0]] = returned.astype(dtype)
        full[returned.shape[0] : n - 1] = -1
        data = base64.b64encode(np.ascontiguousarray(full).tobytes()).decode("ascii")
        envelope = f"nrlre1:{np.dtype(dtype).name}:{n}x{spec.num_layers}x{spec.topk}:{data}"
        message = {
            "role": "assistant",
            "content": "<detokenized>",
            "reasoning": None,
            "tool_calls": [],
            "routed_experts": envelope,
            "prompt_token_ids": toks[:p].tolist(),
            "generation_token_ids": toks[p:].tolist(),
            "generation_log_probs": [-0.5] * r,
        }
        responses.append(
            {
                "id": f"chatcmpl-nrl{i}",
                "object": "chat.completion",
                "created": 1767225600,
                "model": spec.name,
                "choices": [
                    {"index": 0, "message": message, "logprobs": None, "finish_reason": "length", "stop_reason": None}
                ],
                "usage": {"prompt_tokens": p, "completion_tokens": r, "total_tokens": n},
            }
        )
        fx.add(f"chatcmpl-nrl{i}", ids, span(n, 0, n - 1 - missing), toks)
    fx.payload["responses.json"] = responses
    fx.notes = {"1": {"missing_rows": [12 - 3, 12], "sentinel": -1}, "final_row": "dummy arange(K), never valid"}
    fx.files = {"responses.json": "two chat responses (vLLM ChatCompletionResponse + NeMo-RL message fields)"}
    return fx


# -- FACTS.md -----------------------------------------------------------------------------------------------------
FACTS_MARKER = "<!-- Everything below this line is generated by tools/make_engine_fixtures.py -->"


def write_facts(out: Path, fixtures: list[Fixture]) -> None:
    """Rewrite the generated part of ``FACTS.md`` (below the marker); the hand-written summary above is kept."""
    path = out / "FACTS.md"
    head = "# Engine routing payloads: verified facts\n\n"
    if path.exists() and FACTS_MARKER in path.read_text():
        head = path.read_text().split(FACTS_MARKER)[0]
    parts = [head, FACTS_MARKER, "\n\n## Every verified fact, per fixture (file inside the wheel : line)\n"]
    for fx in fixtures:
        parts.append(f"\n### `{fx.name}` ({fx.engine} {fx.version})\n\n{fx.description}\n\n")
        parts.append("| where | fact |\n|---|---|\n")
        seen: set[tuple[str, str]] = set()
        for where, text in fx.facts:
            if (where, text) not in seen:
                seen.add((where, text))
                parts.append(f"| {where} | {text.replace('|', '/')} |\n")
    path.write_text("".join(parts))


# -- main ---------------------------------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="fixture root (default: %(default)s)")
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="wheel cache (default: %(default)s)")
    parser.add_argument("--only", action="append", default=[], help="build only this fixture (repeatable)")
    parser.add_argument("--list", action="store_true", help="list the fixtures and exit")
    args = parser.parse_args(argv)
    if args.list:
        print("\n".join(BUILDERS))
        return 0
    unknown = [n for n in args.only if n not in BUILDERS]
    if unknown:
        parser.error(f"unknown fixture(s) {unknown}; see --list")
    ctx = Ctx(args.cache)
    args.out.mkdir(parents=True, exist_ok=True)
    names = args.only or list(BUILDERS)
    built = []
    for name in names:
        fx = BUILDERS[name](ctx)
        fx.write(args.out)
        built.append(fx)
        print(f"{name}: {len(fx.samples)} sample(s)", file=sys.stderr)
    if not args.only:
        write_facts(args.out, built)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
