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
  ``<i>_token_ids`` (int64), ``sample_ids`` (unicode array) and, for a DSA model's indexer top-k, ``<i>_indexer``
  (int32 ``[n_tokens, computing layers, index_topk]``: routelog's rows, ascending, -1 last, the final token -1);
* ``model_spec.json`` (routelog ``ModelSpec`` JSON), ``SOURCE.json`` (engine, version, wheel, sha256 of each source
  file used, the names taken from it, the lines asserted, a description) and ``notes.json`` where a sample needs one.

``FACTS.md`` (all verified facts with file and line) is rewritten when every fixture is built.

Layout: each fixture is one ``fill(ctx, fx, **options)`` function registered with :func:`builder` (its docstring is
the fixture description) or, where fixtures differ only in constants, one shared function registered per row of a
:func:`variants` table. Per-version source objects (``_V021``, ``_V022Plus``, ``_SGLang``) read a wheel's files once,
record them with :meth:`Fixture.cite` and build the engine's response objects from its declared fields. Every run
draws the same data (seeded by the fixture name), so rerunning rewrites byte-identical files.

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
import functools
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
from typing import Any, NamedTuple

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
    indexer: dict[str, Any] | None = None
    """routelog ``IndexerSpec`` JSON of a DSA model (``index_topk``, computing ``layers``, ``shared`` layers)."""

    @property
    def n_moe(self) -> int:
        return len(self.moe_layers)

    def model_spec_json(self) -> dict[str, Any]:
        spec = {
            "name": self.name,
            "num_layers": self.num_layers,
            "moe_layers": list(self.moe_layers),
            "num_experts": self.num_experts,
            "topk": self.topk,
        }
        return spec if self.indexer is None else {**spec, "indexer": self.indexer}


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
GLM_DSA = Spec(  # GLM-5-like: layers 2 and 4 reuse the indexer selection of layers 1 and 3 (index_topk_freq 2)
    "tiny-glm-moe-dsa",
    6,
    (1, 2, 3, 4, 5),
    16,
    2,
    {
        "model_type": "glm_moe_dsa",
        "architectures": ["GlmMoeDsaForCausalLM"],
        "num_hidden_layers": 6,
        "first_k_dense_replace": 1,
        "n_routed_experts": 16,
        "num_experts_per_tok": 2,
        "index_topk": 4,
        "index_topk_freq": 2,
        "index_skip_topk_offset": 2,
    },
    {"index_topk": 4, "layers": [0, 1, 3, 5], "shared": [2, 4]},
)
V32 = Spec(  # DeepSeek-V3.2-like: every layer computes its own selection
    "tiny-deepseek-v32",
    4,
    (1, 2, 3),
    16,
    2,
    {
        "model_type": "deepseek_v32",
        "architectures": ["DeepseekV32ForCausalLM"],
        "num_hidden_layers": 4,
        "first_k_dense_replace": 1,
        "n_routed_experts": 16,
        "num_experts_per_tok": 2,
        "index_topk": 4,
    },
    {"index_topk": 4, "layers": [0, 1, 2, 3], "shared": []},
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

    def has(self, member: str) -> bool:
        with zipfile.ZipFile(self.path) as archive:
            return member in archive.namelist()

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
    indexer: npt.NDArray[np.int32] | None = None  # [n_tokens, computing layers, index_topk] canonical rows


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

    def cite(
        self,
        src: SourceFile,
        names: Sequence[str] | None,
        description: str,
        lines: dict[str, int],
        fact: str,
        *,
        on: str | None = None,
    ) -> int:
        """``use`` and one ``fact`` about ``lines[on]`` (default: the first line); ``names`` default to the definition
        enclosing that line. Sources and facts are kept in two separate lists, so citing one source after another
        records both in the same order as separate ``use``/``fact`` calls would."""
        line = lines[on or next(iter(lines))]
        self.use(src, [src.enclosing(line)] if names is None else names, description, lines)
        self.fact(src, line, fact)
        return line

    def rng(self) -> np.random.Generator:
        """Random source seeded by the fixture name: every run draws the same tokens and routes."""
        return np.random.default_rng(zlib.crc32(self.name.encode()))

    def add(
        self,
        sample_id: str,
        ids_moe: IntArray,
        valid: npt.NDArray[np.bool_],
        tokens: IntArray,
        indexer: npt.NDArray[np.int32] | None = None,
    ) -> None:
        ids = np.where(valid[:, None, None], ids_moe, 0).astype(np.int64)
        self.samples.append(Sample(sample_id, ids, valid.astype(bool), np.asarray(tokens, dtype=np.int64), indexer))

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
            if sample.indexer is not None:
                arrays[f"{i}_indexer"] = sample.indexer
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
def routes(rng: np.random.Generator, n: int, spec: Spec) -> IntArray:
    """``[n, n_moe, K]`` distinct logical expert IDs per row in score order (not sorted)."""
    scores = rng.random((n, spec.n_moe, spec.num_experts))
    return np.argsort(-scores, axis=-1)[..., : spec.topk].astype(np.int64)


def tokens(rng: np.random.Generator, n: int) -> IntArray:
    return rng.integers(1000, 50000, n).astype(np.int64)


def draw(
    rng: np.random.Generator, spec: Spec, n: int, after: tuple[IntArray, IntArray] | None = None
) -> tuple[IntArray, IntArray]:
    """``n`` token IDs and their routes (tokens drawn first), appended to ``after`` (a shared prompt or prefix)."""
    toks, ids = tokens(rng, n), routes(rng, n, spec)
    if after is None:
        return toks, ids
    return np.concatenate([after[0], toks]), np.concatenate([after[1], ids])


def full_axis(ids_moe: IntArray, spec: Spec) -> IntArray:
    """The engine's capture on the full decoder axis: MoE layer ``moe_layers[j]`` holds column j, dense layers 0."""
    out = np.zeros((ids_moe.shape[0], spec.num_layers, spec.topk), dtype=np.int64)
    out[:, list(spec.moe_layers)] = ids_moe
    return out


def captured_rows(ids_moe: IntArray, spec: Spec, dtype: npt.DTypeLike, start: int = 0) -> npt.NDArray[Any]:
    """Full-axis rows ``[start, n - 1)`` in ``dtype``, as vLLM 0.22+ / SGLang / slime return them (no final row)."""
    return full_axis(ids_moe, spec)[start : ids_moe.shape[0] - 1].astype(dtype)


def span(n: int, start: int, stop: int) -> npt.NDArray[np.bool_]:
    valid = np.zeros(n, dtype=bool)
    valid[start:stop] = True
    return valid


def returned(n: int, start: int = 0) -> npt.NDArray[np.bool_]:
    """Valid mask of the rows an engine returns for ``n`` tokens: ``[start, n - 1)`` (the final token has none)."""
    return span(n, start, n - 1)


def b64_npy_load(text: str) -> npt.NDArray[Any]:
    return np.asarray(np.load(io.BytesIO(base64.b64decode(text)), allow_pickle=False))


# -- OpenAI-style envelopes shared by the engines -----------------------------------------------------------------
CREATED = 1767225600  # fixed `created` timestamp (2026-01-01): reruns write identical bytes


def openai_envelope(
    chat: bool, rid: str, spec: Spec, choices: list[dict[str, Any]], usage: dict[str, Any]
) -> dict[str, Any]:
    """The fields every (chat) completion response has, in OpenAI's order."""
    return {
        "id": rid,
        "object": "chat.completion" if chat else "text_completion",
        "created": CREATED,
        "model": spec.name,
        "choices": choices,
        "usage": usage,
    }


Dump = Callable[[SourceFile, str, dict[str, Any]], dict[str, Any]]


def openai_response(
    proto: SourceFile,
    chat: bool,
    rid: str,
    spec: Spec,
    choices: list[dict[str, Any]],
    usage: dict[str, Any],
    *,
    dump: Dump = dump_model,
    **fields: Any,
) -> dict[str, Any]:
    """``(Chat)CompletionResponse`` as ``proto`` declares it: the envelope plus the engine's extra ``fields``."""
    cls = "ChatCompletionResponse" if chat else "CompletionResponse"
    return dump(proto, cls, {**openai_envelope(chat, rid, spec, choices, usage), **fields})


def vllm_usage(prompt: int, completion: int, cached: int = 0) -> dict[str, Any]:
    """vLLM's ``UsageInfo`` as serialized (declared field order; details only after a prefix-cache hit)."""
    return {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": {"cached_tokens": cached} if cached else None,
    }


def plain_usage(prompt: int, completion: int) -> dict[str, int]:
    """Usage as ms-swift and NeMo-RL write it (OpenAI's order, no details)."""
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def chat_request(spec: Spec, **fields: Any) -> dict[str, Any]:
    """A one-message chat request body; ``fields`` follow in the order given."""
    return {"model": spec.name, "messages": [{"role": "user", "content": "hi"}], **fields}


# -- builders -----------------------------------------------------------------------------------------------------
@dataclass
class Ctx:
    cache: Path

    def wheel(self, dist: str, version: str) -> Wheel:
        return Wheel(dist, version, self.cache)


Builder = Callable[[Ctx], Fixture]
Fill = Callable[..., None]  # fill(ctx, fx, **options): adds payload, samples and provenance to a fresh fixture
BUILDERS: dict[str, Builder] = {}  # registration order = build order = order in FACTS.md


def builder(
    name: str, engine: str, version: str, spec: Spec, description: str | None = None, **options: Any
) -> Callable[[Fill], Fill]:
    """Register ``fill`` as the builder of fixture ``name``; ``options`` are passed on to it. The fixture's
    description (SOURCE.json, FACTS.md) is ``description``, by default ``fill``'s docstring as one line."""

    def register(fill: Fill) -> Fill:
        text = " ".join((fill.__doc__ or "").split()) if description is None else description

        def build(ctx: Ctx) -> Fixture:
            fx = Fixture(name, engine, version, spec, text)
            fill(ctx, fx, **options)
            return fx

        BUILDERS[name] = build
        return fill

    return register


Variant = tuple[str, str, Spec, str, dict[str, Any]]  # name, version, spec, description, options


def variants(fill: Fill, engine: str, *table: Variant) -> None:
    """Register one ``fill`` for several fixtures that differ only in constants."""
    for name, version, spec, description, options in table:
        builder(name, engine, version, spec, description, **options)(fill)


class _Sources:
    """The wheel of a fixture's engine version; subclasses read the files they need and record them on ``fx``."""

    def __init__(self, ctx: Ctx, fx: Fixture) -> None:
        self.fx = fx
        self.version = fx.version
        self.wheel = ctx.wheel(fx.engine, fx.version)


VLLM_CAPTURER = "vllm/model_executor/layers/fused_moe/routed_experts_capturer.py"
VLLM_ROUTER = "vllm/model_executor/layers/fused_moe/router/base_router.py"


class DtypeRule(NamedTuple):
    """vLLM's expert-ID dtype rule as written in one version's capturer."""

    expr: str
    line: int
    owner: str
    dtype_of: Callable[[int], np.dtype[Any]]


def vllm_dtype_rule(capturer: SourceFile) -> DtypeRule:
    """``uint8 if E <= 256 else uint16``, read from the capturer (0.33 names it ``output_dtype_name``)."""
    if "self.output_dtype_name =" in capturer.text:
        owner, target = "RoutedExpertsCapturer.__init__", "self.output_dtype_name"
    else:
        owner, target = "RoutedExpertsManager.__init__", "expert_id_dtype"
    expr, line = capturer.expression(owner, target)
    return DtypeRule(expr, line, owner, lambda e: np.dtype(eval(expr, {"num_experts": e, "np": np})))


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


def _vllm_inprocess(ctx: Ctx, fx: Fixture, *, eplb: bool) -> None:
    """Two in-process requests, the second hitting the first's prefix blocks; with ``eplb``, physical IDs."""
    spec, version = fx.spec, fx.version
    wheel = ctx.wheel("vllm", version)
    outputs = wheel.read("vllm/outputs.py")
    scheduler = wheel.read("vllm/v1/core/sched/scheduler.py")
    capturer = wheel.read(VLLM_CAPTURER)
    layer = wheel.read("vllm/model_executor/layers/fused_moe/layer.py")
    fx.cite(
        outputs,
        ["CompletionOutput", "RequestOutput"],
        "Field names of the in-process output objects.",
        {"CompletionOutput.routed_experts": outputs.line("routed_experts: np.ndarray | None = None")},
        "`CompletionOutput.routed_experts: np.ndarray | None` (in-process only; no HTTP field in this version)",
    )
    fx.cite(
        capturer,
        ["RoutedExpertsCapturer.init_buffer"],
        "Host buffer (max_num_kv_tokens, num_hidden_layers, K) int32 indexed by KV slot.",
        {
            "num_layers": capturer.line("num_layers = hf_config.num_hidden_layers"),
            "int32": capturer.line("dtype=np.int32, buffer=self._shm.buf"),
        },
        "layer axis = `hf_config.num_hidden_layers` (full axis, dense layers stay 0); "
        "host buffer int32 in POSIX shared memory indexed by KV slot",
    )

    block_size = 4
    rng = fx.rng()
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
        fx.cite(
            layer,
            [layer.enclosing(capture_line), "FusedMoE.layer_id"],
            "Capture runs after the EPLB mapping: "
            "physical IDs; layer_id = extract_layer_index(layer_name) (global index).",
            {"eplb_map": eplb_line, "capture": capture_line},
            f"capture after `eplb_map_to_physical_and_record` (line {eplb_line}): "
            "**physical** expert IDs under EPLB; layer id = `extract_layer_index(self.layer_name)`",
            on="capture",
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
        router = wheel.read(VLLM_ROUTER)
        runner = wheel.read("vllm/v1/worker/gpu_model_runner.py")
        fx.cite(
            router,
            ["BaseRouter.select_experts"],
            "capture_fn runs before _apply_eplb_mapping: logical IDs.",
            {"capture_logical": router.line("# Capture logical ids before EPLB mapping.")},
            "capture before EPLB mapping: **logical** IDs",
        )
        fx.cite(
            runner,
            ["GPUModelRunner._bind_routed_experts_capturer"],
            "Binds capture_fn with FusedMoE.layer_id (global decoder index).",
            {"bind": runner.line("layer_id = module.layer_id", after="def _bind_routed_experts_capturer")},
            "capturer bound per FusedMoE with `module.layer_id` (global layer index)",
        )

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
        output = {
            "index": 0,
            "text": "",
            "token_ids": toks[p:].tolist(),
            "finish_reason": "length",
            "stop_reason": None,
            "routed_experts": {"npz": "routed_experts.npz", "key": key},
        }
        request_outputs.append(
            {
                "request_id": rid,
                "prompt_token_ids": toks[:p].tolist(),
                "num_cached_tokens": computed_from,
                "finished": True,
                "outputs": [output],
            }
        )
        fx.add(f"{rid}/0", ids, returned(n), toks)
    fx.cite(
        scheduler,
        ["Scheduler._get_routed_experts" if version != "0.14.1" else "Scheduler.update_from_output"],
        "Executed: slot mapping from the request's KV blocks, `num_tokens - 1` rows read from the host buffer "
        "(prefix-cache hits read the shared blocks' slots, so they come back filled).",
        {"readback": line},
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


variants(
    _vllm_inprocess,
    "vllm",
    (
        "vllm-0.16.0-inprocess",
        "0.16.0",
        DEEPSEEK,
        "vLLM 0.16.0 in-process CompletionOutput.routed_experts: int32, full decoder axis (dense "
        "layers 0), n_tokens - 1 rows; req-B hits req-A's 2 prefix blocks and gets them filled.",
        {"eplb": False},
    ),
    (
        "vllm-0.14.1-inprocess-eplb",
        "0.14.1",
        DEEPSEEK,
        "vLLM 0.14.1 in-process CompletionOutput.routed_experts under EPLB: PHYSICAL expert IDs "
        "(captured after the logical->physical mapping), full decoder axis int32, with the EPLB "
        "physical->logical table. req-B hits req-A's prefix blocks (rows filled).",
        {"eplb": True},
    ),
)


# ---- vLLM OpenAI server (0.21+) ----
class _VllmServer(_Sources):
    """vLLM's OpenAI server files, and response objects built from the declared fields of their classes."""

    def __init__(self, ctx: Ctx, fx: Fixture) -> None:
        super().__init__(ctx, fx)
        read = self.wheel.read
        self.cmpl_proto = read("vllm/entrypoints/openai/completion/protocol.py")
        self.cmpl_serving = read("vllm/entrypoints/openai/completion/serving.py")
        self.chat_proto = read("vllm/entrypoints/openai/chat_completion/protocol.py")
        self.chat_serving = read("vllm/entrypoints/openai/chat_completion/serving.py")

    def cmpl_choice(
        self, index: int, toks: IntArray, p: int, routed: Any, *, text: str, finish: str = "length", **fields: Any
    ) -> dict[str, Any]:
        """``CompletionResponseChoice`` for prompt ``toks[:p]`` and output ``toks[p:]`` (``return_token_ids``)."""
        values = {
            "index": index,
            "text": text,
            "finish_reason": finish,
            "prompt_token_ids": toks[:p].tolist(),
            "token_ids": toks[p:].tolist(),
            "routed_experts": routed,
        }
        return dump_model(self.cmpl_proto, "CompletionResponseChoice", values | fields)

    def chat_choice(self, toks: IntArray, p: int, routed: Any) -> dict[str, Any]:
        """The single ``ChatCompletionResponseChoice`` for output ``toks[p:]``."""
        message = {"role": "assistant", "content": "<detokenized>", "tool_calls": []}
        values = {
            "index": 0,
            "message": dump_model(self.chat_proto, "ChatMessage", message),
            "finish_reason": "length",
            "token_ids": toks[p:].tolist(),
            "routed_experts": routed,
        }
        return dump_model(self.chat_proto, "ChatCompletionResponseChoice", values)

    def response(
        self, chat: bool, rid: str, choices: list[dict[str, Any]], usage: dict[str, Any], **fields: Any
    ) -> dict[str, Any]:
        proto = self.chat_proto if chat else self.cmpl_proto
        return openai_response(proto, chat, rid, self.fx.spec, choices, usage, **fields)


# ---- vLLM 0.21: MoE-only int16 axis, prompt rows once per response ----
class _V021(_VllmServer):
    """vLLM 0.21.0: capture sizing, prompt/generation split and finish paths, executed from its own files."""

    def __init__(self, ctx: Ctx, fx: Fixture) -> None:
        super().__init__(ctx, fx)
        wheel = self.wheel
        self.capturer = c = wheel.read(VLLM_CAPTURER)
        self.count = load_def(c, "_count_moe_layers")
        self.split = load_def(c, "split_routed_experts")
        self.engine = wheel.read("vllm/v1/engine/__init__.py")
        self.outproc = wheel.read("vllm/v1/engine/output_processor.py")
        layer = wheel.read("vllm/model_executor/layers/fused_moe/layer.py")
        runner = wheel.read("vllm/model_executor/layers/fused_moe/runner/moe_runner.py")
        lines = {
            "DTYPE": c.line("DTYPE = np.int16"),
            "count": c.line("def _count_moe_layers"),
            "num_hidden_layers": c.line("self.num_hidden_layers = _count_moe_layers(model_config.hf_text_config)"),
            "extract_on_predicted_finish": c.line("def extract_routed_experts_for_current_batch"),
            "preempted_dropped": c.line("dropped without being emitted on a ``ModelRunnerOutput``"),
        }
        fx.use(
            c,
            ["_count_moe_layers", "split_routed_experts"],
            "Executed: the MoE-layer count that sizes the "
            "int16 buffers (ignores first_k_dense_replace) and the prompt/generation split.",
            lines,
        )
        fx.fact(
            c,
            lines["DTYPE"],
            "device/host buffers int16; host buffer per request indexed by token "
            "position (prefix-cache hits are never scattered: zero rows)",
        )
        fx.fact(
            c,
            lines["count"],
            "layer axis length = `_count_moe_layers(hf_text_config)`: "
            "handles layers_block_type / decoder_sparse_step / mlp_only_layers, NOT first_k_dense_replace "
            f"(tiny DeepSeek spec: {self.axis(DEEPSEEK)} layers for "
            f"{DEEPSEEK.n_moe} MoE layers -> trailing all-zero layers)",
        )
        fx.cite(
            layer,
            ["FusedMoE.__init__"],
            "moe_layer_id is a sequential counter over FusedMoE modules.",
            {"moe_layer_id": layer.line("self.moe_layer_id = FusedMoE._next_moe_layer_id")},
            "MoE layer index = sequential counter (j-th FusedMoE built -> column j): MoE-only axis",
        )
        fx.cite(
            runner,
            ["MoERunner._apply_quant_method"],
            "routing written after router.select_experts (which applies the EPLB mapping): physical IDs under EPLB.",
            {
                "routing_replay_out": runner.line(
                    "routing_replay_out[: topk_ids.shape[0]].copy_(topk_ids.to(torch.int16))"
                )
            },
            "routing copied after `router.select_experts()` (post-EPLB): **physical** IDs; "
            "`BaseRouter.capture_fn` exists but nothing calls `set_capture_fn`",
        )
        fx.use(
            self.engine,
            ["FINISH_REASON_STRINGS"],
            "finish_reason strings.",
            {"FINISH_REASON_STRINGS": self.engine.line("FINISH_REASON_STRINGS = (")},
        )
        fx.fact(
            c,
            lines["extract_on_predicted_finish"],
            "rows extracted only for requests "
            "predicted to finish in the runner (EOS, stop_token_ids, max_tokens, max_model_len): stop STRINGS "
            "are not predicted -> routed_experts None",
        )
        fx.fact(
            c, lines["preempted_dropped"], "preempted requests: host buffer freed, routed_experts None, no other signal"
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

    def response_fields(self, chat: bool, lines: dict[str, int] | None = None) -> None:
        names = (
            ["ChatCompletionResponse", "ChatCompletionResponseChoice"]
            if chat
            else ["CompletionResponse", "CompletionResponseChoice"]
        )
        self.fx.use(self.chat_proto if chat else self.cmpl_proto, names, "Response field names.", lines)

    def finish_path(self, needle: str, key: str, description: str, fact: str) -> None:
        """Cite the output processor's line that ends a request without routing."""
        self.fx.cite(self.outproc, None, description, {key: self.outproc.line(needle)}, fact)
        self.response_fields(chat=False)

    def unrouted(self, rid: str, toks: IntArray, ids: IntArray, p: int, **choice: Any) -> dict[str, Any]:
        """A one-choice CompletionResponse with null routing; the sample is recorded with no valid row."""
        self.fx.add(rid, ids, np.zeros(toks.shape[0], dtype=bool), toks)
        return self.response(
            False, rid, [self.cmpl_choice(0, toks, p, None, **choice)], vllm_usage(p, toks.shape[0] - p)
        )


@builder("vllm-0.21.0-completions-multiprompt", "vllm", "0.21.0", DEEPSEEK)
def vllm_021_completions(ctx: Ctx, fx: Fixture) -> None:
    """vLLM 0.21.0 /v1/completions with three token prompts in one request: response-level prompt_routed_experts (int16
    nested lists, MoE-only axis counted without first_k_dense_replace -> 2 trailing zero layers) is taken from the
    FIRST result only, so prompts 1 and 2 get prompt 0's prompt rows (silent misread); choices[i].routed_experts =
    generation rows.
    """
    spec = fx.spec
    v = _V021(ctx, fx)
    s, proto = v.cmpl_serving, v.cmpl_proto
    fx.cite(
        s,
        None,
        "prompt_routed_experts from "
        "final_res_batch[0] only; choices' routed_experts = CompletionOutput.routed_experts.tolist().",
        {
            "prompt_routed_experts_first_result": s.line("pre = final_res_batch[0].prompt_routed_experts"),
            "choice_tolist": s.line("output.routed_experts.tolist()"),
        },
        "/v1/completions: `prompt_routed_experts = final_res_batch[0].prompt_routed_experts.tolist()` "
        "-> with several prompts only prompt 0's prompt rows are returned",
    )
    prompt_line = proto.line("prompt_routed_experts: list[list[list[int]]] | None")
    v.response_fields(
        chat=False,
        lines={
            "choice.routed_experts": proto.line("routed_experts: list[list[list[int]]] | None = None"),
            "prompt_routed_experts": prompt_line,
        },
    )
    fx.fact(
        proto,
        prompt_line,
        "response-level `prompt_routed_experts` [prompt_len, L', K] + `choices[i].routed_experts` "
        "[gen_len - 1, L', K], nested JSON int lists",
    )
    fx.cite(
        v.outproc,
        None,
        "split into prompt rows [:prompt_len] (RequestOutput) "
        "and generation rows (CompletionOutput), either None when empty.",
        {"split": v.outproc.line("prompt_routed_experts, gen_routed_experts = split_routed_experts(")},
        "prompt rows [:prompt_len] -> RequestOutput.prompt_routed_experts; rows "
        "[prompt_len:] -> CompletionOutput.routed_experts (None when 0 rows, e.g. a 1-token output)",
    )

    rng = fx.rng()
    lens = [(7, 4), (7, 5), (6, 3)]  # prompt 1 has prompt 0's length: its misread passes every shape check
    prompts: list[list[int]] = []
    request = {"model": spec.name, "prompt": prompts, "max_tokens": 5, "return_token_ids": True}
    choices = []
    first_prompt_rows = None
    for i, (p, r) in enumerate(lens):
        toks, ids = draw(rng, spec, p + r)
        prompts.append(toks[:p].tolist())
        prompt_rows, gen_rows = v.choice_rows(v.engine_rows(ids, spec, 0), p, r)
        if i == 0:
            first_prompt_rows = prompt_rows
        routed = None if gen_rows is None else gen_rows.tolist()
        choices.append(v.cmpl_choice(i, toks, p, routed, text=f"<detokenized {r} tokens>"))
        valid = returned(p + r)
        if i > 0:
            valid[:p] = False  # the response carries prompt 0's rows, not this prompt's
        fx.add(f"cmpl-021multi/{i}", ids, valid, toks)
    assert first_prompt_rows is not None
    usage = vllm_usage(sum(p for p, _ in lens), sum(r for _, r in lens))
    fx.payload["request.json"] = request
    fx.payload["response.json"] = v.response(
        False, "cmpl-021multi", choices, usage, prompt_routed_experts=first_prompt_rows.tolist()
    )
    why = {"prompt_rows_unknown": True, "why": "prompt_routed_experts holds prompt 0's rows (final_res_batch[0])"}
    fx.notes = {
        "1": why,
        "2": why,
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


@builder("vllm-0.21.0-chat-prefixcache", "vllm", "0.21.0", DEEPSEEK)
def vllm_021_chat(ctx: Ctx, fx: Fixture) -> None:
    """vLLM 0.21.0 /v1/chat/completions whose first 8 prompt tokens hit the prefix cache: those prompt rows are zeros
    (never scattered into the per-request host buffer); MoE-only int16 axis with 2 trailing zero layers for the
    DeepSeek-style spec.
    """
    spec = fx.spec
    v = _V021(ctx, fx)
    s = v.chat_serving
    fx.cite(
        s,
        None,
        "prompt_routed_experts from the request's RequestOutput; choices' routed_experts = .tolist().",
        {"prompt_routed_experts": s.line("prompt_routed_experts = final_res.prompt_routed_experts.tolist()")},
        "/v1/chat/completions: response-level `prompt_routed_experts` from its single RequestOutput",
    )
    v.response_fields(chat=True)
    p, r, cached = 12, 5, 8
    toks, ids = draw(fx.rng(), spec, p + r)
    prompt_rows, gen_rows = v.choice_rows(v.engine_rows(ids, spec, cached), p, r)
    fx.payload["request.json"] = chat_request(spec, max_tokens=r, return_token_ids=True)
    fx.payload["response.json"] = v.response(
        True,
        "chatcmpl-021prefix",
        [v.chat_choice(toks, p, gen_rows.tolist())],
        vllm_usage(p, r, cached),
        prompt_routed_experts=prompt_rows.tolist(),
        prompt_token_ids=toks[:p].tolist(),
    )
    fx.add("chatcmpl-021prefix", ids, returned(p + r, cached), toks)
    fx.notes = {
        "0": {"prefix_cached_rows": [0, cached], "why": "prefix-cache hit: 0.21 has no restore path, rows are zeros"}
    }
    fx.files = {"request.json": "chat request", "response.json": "ChatCompletionResponse (vLLM 0.21.0)"}


@builder("vllm-0.21.0-completions-stopstring", "vllm", "0.21.0", QWEN)
def vllm_021_stop(ctx: Ctx, fx: Fixture) -> None:
    """vLLM 0.21.0 /v1/completions that ended on a stop STRING: the frontend detokenizer finishes the request, the
    runner never predicted the finish, so routed_experts and prompt_routed_experts are null; finish_reason 'stop',
    stop_reason = the string.
    """
    spec = fx.spec
    v = _V021(ctx, fx)
    v.finish_path(
        "finish_reason = FinishReason.STOP",
        "stop_string",
        "stop string detected in the frontend: finish_reason "
        "STOP, stop_reason = the string, routed_experts only from EngineCoreOutput (None here).",
        "stop string -> finish_reason 'stop', stop_reason '<string>'; "
        "routed_experts/prompt_routed_experts null (0.21.0)",
    )
    p, r = 6, 4
    toks, ids = draw(fx.rng(), spec, p + r)
    fx.payload["request.json"] = {
        "model": spec.name,
        "prompt": toks[:p].tolist(),
        "max_tokens": 16,
        "stop": ["</answer>"],
        "return_token_ids": True,
    }
    fx.payload["response.json"] = v.unrouted(
        "cmpl-021stop", toks, ids, p, text="<answer>42", finish="stop", stop_reason="</answer>"
    )
    fx.notes = {"0": {"routing_absent": True, "why": "stop-string finish: vLLM 0.21.0 returns null routing"}}
    fx.files = {"request.json": "request with a stop string", "response.json": "CompletionResponse (null routing)"}


@builder("vllm-0.21.0-completions-abort", "vllm", "0.21.0", QWEN)
def vllm_021_abort(ctx: Ctx, fx: Fixture) -> None:
    """vLLM 0.21.0: an aborted request (finish_reason 'abort', null routing) and a request that was preempted and
    finished normally (finish_reason 'length', null routing, no marker at all).
    """
    v = _V021(ctx, fx)
    v.finish_path(
        "finish_reason=FinishReason.ABORT",
        "abort",
        "abort produces a final output with FinishReason.ABORT and no routed_experts.",
        "abort: final output finish_reason 'abort', routed_experts None (0.21 passes no routing on the abort path)",
    )
    rng = fx.rng()
    responses = []
    for i, (finish, p, r) in enumerate((("abort", 6, 3), ("length", 7, 4))):
        toks, ids = draw(rng, fx.spec, p + r)
        responses.append(v.unrouted(f"cmpl-021abort{i}", toks, ids, p, text="<partial>", finish=finish))
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


# ---- vLLM 0.22+: base64 .npy per choice, full axis uint8/uint16 ----
class _V022Plus(_VllmServer):
    """Encoding and dtype rules of one vLLM version >= 0.22, executed from its own files."""

    def __init__(self, ctx: Ctx, fx: Fixture) -> None:
        super().__init__(ctx, fx)
        wheel, version = self.wheel, self.version
        self.sampling = wheel.read("vllm/sampling_params.py")
        capturer = wheel.read(VLLM_CAPTURER)
        fx.cite(
            self.sampling,
            ["SamplingParams.routed_experts_prompt_start"],
            "per-request start offset field.",
            {"routed_experts_prompt_start": self.sampling.line("routed_experts_prompt_start: int = 0")},
            "`SamplingParams.routed_experts_prompt_start: int = 0` (rows start there)",
        )
        if "numpy2base64" in self.cmpl_serving.text:
            serial = wheel.read("vllm/utils/serial_utils.py")
            self.encode: Callable[[npt.NDArray[Any]], str] = load_def(serial, "numpy2base64")
            fx.cite(
                serial,
                ["numpy2base64"],
                "Executed: np.save(allow_pickle=False) + pybase64.b64encode (stdlib base64 gives identical bytes).",
                {"numpy2base64": serial.line("def numpy2base64")},
                "encoding: `numpy2base64` = base64(np.save(array, "
                "allow_pickle=False)); serving calls it for choices[i].routed_experts",
            )
        else:
            serving = self.cmpl_serving
            where = serving.enclosing(serving.line("np.save(buf, output.routed_experts)"))
            block, line = serving.if_block(
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
            fx.cite(
                serving,
                [where],
                "Executed: the inline `if output.routed_experts is not None:` block (np.save + pybase64 b64encode).",
                {"inline_np_save": line},
                "encoding inline in serving.py: base64(np.save(array)) (pybase64 imported as base64)",
            )
        rule = vllm_dtype_rule(capturer)
        self.dtype_of = rule.dtype_of
        axis_line = (
            capturer.line("num_layers = model_config.get_total_num_hidden_layers()")
            if "get_total_num_hidden_layers()" in capturer.text
            else capturer.line("hf_config.num_hidden_layers,", after="self.routed_experts_by_slot = np.zeros")
        )
        fx.cite(
            capturer,
            ["dtype rule", "layer axis"],
            f"Executed: `{rule.expr}`; buffers sized by the total hidden layer count (full axis).",
            {"dtype": rule.line, "axis": axis_line},
            f"dtype: `{rule.expr}` (uint8 if E <= 256 else uint16)",
        )
        fx.fact(capturer, axis_line, "layer axis: total num_hidden_layers (full axis, dense layers 0)")
        router = wheel.read(VLLM_ROUTER)
        fx.cite(
            router,
            ["BaseRouter.select_experts"],
            "capture before EPLB mapping: logical IDs.",
            {"capture": router.line("# Capture logical ids before EPLB mapping.")},
            "capture_fn before `_apply_eplb_mapping`: **logical** IDs",
        )

    def cite_choice_field(self, chat: bool, description: str, fact: str) -> None:
        """Cite the choice field ``routed_experts: str | None`` and the classes of the (chat) completions API."""
        proto = self.chat_proto if chat else self.cmpl_proto
        prefix = "Chat" if chat else ""
        names = [f"{prefix}CompletionResponse", f"{prefix}CompletionResponseChoice", f"{prefix}CompletionRequest"]
        line = proto.line("routed_experts: str | None = None")
        self.fx.cite(proto, names, description, {"choice.routed_experts": line}, fact)

    def rows(self, ids_moe: IntArray, spec: Spec, start: int) -> npt.NDArray[Any]:
        """Rows [start, n - 1) on the full axis in the version's dtype (prefix hits filled: KV-slot / block store)."""
        return captured_rows(ids_moe, spec, self.dtype_of(spec.num_experts), start)

    def b64(self, ids_moe: IntArray, spec: Spec, start: int) -> str:
        text = self.encode(self.rows(ids_moe, spec, start))
        back = b64_npy_load(text)
        assert back.dtype == self.dtype_of(spec.num_experts)
        return text


def _completions_022plus(ctx: Ctx, fx: Fixture, *, start: int | None, n_choices: int) -> None:
    """/v1/completions with ``n_choices`` choices of one prompt and an optional request-level start."""
    spec, version = fx.spec, fx.version
    v = _V022Plus(ctx, fx)
    proto = v.cmpl_proto
    v.cite_choice_field(
        chat=False,
        description="Field names.",
        fact="`CompletionResponseChoice.routed_experts: "
        "str | None` (base64 .npy); `prompt_token_ids`/`token_ids` per choice with `return_token_ids`",
    )
    if "routed_experts_prompt_start" in proto.text:
        fx.fact(
            proto,
            proto.line("routed_experts_prompt_start: int = Field("),
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
    rng = fx.rng()
    p = 9
    # n > 1: each child request recomputes / prefix-hits the same prompt rows
    prompt = draw(rng, spec, p)
    request: dict[str, Any] = {
        "model": spec.name,
        "prompt": prompt[0].tolist(),
        "max_tokens": 6,
        "n": n_choices,
        "return_token_ids": True,
    }
    if start is not None:
        assert "routed_experts_prompt_start" in proto.text
        request["routed_experts_prompt_start"] = start
    s = start or 0
    choices = []
    total = 0
    for i in range(n_choices):
        r = 4 + 2 * i
        toks, ids = draw(rng, spec, r, after=prompt)
        finish = "length" if i == 0 else "stop"
        text = f"<detokenized {r} tokens>"
        choices.append(v.cmpl_choice(i, toks, p, v.b64(ids, spec, s), text=text, finish=finish))
        fx.add(f"cmpl-{version}/{i}", ids, returned(p + r, s), toks)
        total += r
    fx.payload["request.json"] = request
    fx.payload["response.json"] = v.response(False, f"cmpl-{version}", choices, vllm_usage(p, total))
    fx.files = {"request.json": "/v1/completions request", "response.json": f"CompletionResponse (vLLM {version})"}
    if start:
        fx.notes = {str(i): {"start": s} for i in range(n_choices)}


variants(
    _completions_022plus,
    "vllm",
    (
        "vllm-0.22.0-completions",
        "0.22.0",
        DEEPSEEK,
        "vLLM 0.22.0 /v1/completions, n=2: each choice carries its own rows [0, n_tokens - 1) as base64 "
        ".npy (inline np.save in serving.py), uint8, full decoder axis (dense layers 0); no request-level "
        "routed_experts_prompt_start yet.",
        {"start": None, "n_choices": 2},
    ),
    (
        "vllm-0.28.0-completions-promptstart",
        "0.28.0",
        DEEPSEEK,
        "vLLM 0.28.0 /v1/completions, n=2, request field routed_experts_prompt_start=5 (first version "
        "with the request field and numpy2base64): rows [5, n_tokens - 1) per choice, uint8, full axis.",
        {"start": 5, "n_choices": 2},
    ),
    (
        "vllm-0.33.0-completions-e300",
        "0.33.0",
        WIDE,
        "vLLM 0.33.0 /v1/completions for a 300-expert model: uint16 .npy (numpy2base64), full axis.",
        {"start": None, "n_choices": 1},
    ),
)


def _chat_022plus(ctx: Ctx, fx: Fixture, *, start: int | None, cached: int) -> None:
    """/v1/chat/completions, optionally with ``routed_experts_prompt_start`` and a ``cached``-token prefix hit."""
    spec, version = fx.spec, fx.version
    v = _V022Plus(ctx, fx)
    proto, serving = v.chat_proto, v.chat_serving
    v.cite_choice_field(
        chat=True,
        description="Field names (prompt_token_ids is response-level in chat, token_ids per choice).",
        fact="`ChatCompletionResponseChoice.routed_experts:"
        " str | None`; chat has response-level `prompt_token_ids` and per-choice `token_ids`",
    )
    where, pt_line = serving.named("prompt_token_ids=", after="routed_experts")
    fx.use(
        serving, [where], "sets response prompt_token_ids and choices' routed_experts.", {"prompt_token_ids": pt_line}
    )
    p, r = 14, 5
    toks, ids = draw(fx.rng(), spec, p + r)
    s = start or 0
    request = chat_request(spec, max_tokens=r, return_token_ids=True)
    if start is not None:
        request["routed_experts_prompt_start"] = start
        fx.fact(
            proto,
            proto.line("routed_experts_prompt_start: int = Field("),
            "chat request field `routed_experts_prompt_start` (top level)",
        )
    fx.payload["request.json"] = request
    fx.payload["response.json"] = v.response(
        True,
        f"chatcmpl-{version}",
        [v.chat_choice(toks, p, v.b64(ids, spec, s))],
        vllm_usage(p, r, cached),
        prompt_token_ids=toks[:p].tolist(),
    )
    fx.add(f"chatcmpl-{version}", ids, returned(p + r, s), toks)
    fx.notes = {"0": {"start": s, "prefix_cached_tokens": cached, "prefix_rows": "filled"}} if (s or cached) else {}
    fx.files = {"request.json": "chat request", "response.json": f"ChatCompletionResponse (vLLM {version})"}


variants(
    _chat_022plus,
    "vllm",
    (
        "vllm-0.28.0-chat",
        "0.28.0",
        QWEN,
        "vLLM 0.28.0 /v1/chat/completions: base64 .npy uint8 (numpy2base64), full axis "
        "(all-MoE model: full = MoE-only), rows [0, n_tokens - 1).",
        {"start": None, "cached": 0},
    ),
    (
        "vllm-0.33.0-chat-promptstart",
        "0.33.0",
        DEEPSEEK,
        "vLLM 0.33.0 /v1/chat/completions with routed_experts_prompt_start=6 and an "
        "8-token prefix-cache hit (rows restored from the block store: filled): rows [6, n - 1).",
        {"start": 6, "cached": 8},
    ),
)


# ---- vLLM /inference/v1/generate ----
def _generate_files(wheel: Wheel) -> tuple[SourceFile, SourceFile]:
    for base in ("vllm/entrypoints/scale_out/token_in_token_out", "vllm/entrypoints/serve/disagg"):
        if wheel.has(f"{base}/protocol.py"):
            return wheel.read(f"{base}/protocol.py"), wheel.read(f"{base}/serving.py")
    raise SystemExit(f"{wheel.label}: no generate protocol")


def _generate(ctx: Ctx, fx: Fixture, *, stream: bool, abort: bool, start: int) -> None:
    """/inference/v1/generate, streamed or not, optionally aborted; the description is derived from the options."""
    spec, version = fx.spec, fx.version
    v = _V022Plus(ctx, fx)
    proto, serving = _generate_files(v.wheel)
    new = version == "0.33.0"  # 0.33 renamed the classes and added output_mode / prompt_token_ids / usage
    resp_cls, choice_cls, stream_cls, stream_choice_cls = (
        ("GenerateTokensResponse", "GenerateTokensChoice", "GenerateTokensStreamResponse", "GenerateTokensStreamChoice")
        if new
        else ("GenerateResponse", "GenerateResponseChoice", "GenerateStreamResponse", "GenerateResponseStreamChoice")
    )
    fx.cite(
        proto,
        ["GenerateRequest", resp_cls, choice_cls, stream_cls, stream_choice_cls],
        "Field names.",
        {
            "request.sampling_params": proto.line("sampling_params: SamplingParams"),
            "choice.routed_experts": proto.line("routed_experts: str | None = None"),
        },
        "request `{token_ids, sampling_params: "
        "SamplingParams}`: `routed_experts_prompt_start` is nested under `sampling_params`",
    )
    stream_fields = proto.fields(stream_choice_cls)
    fx.fact(proto, proto.line(f"class {stream_choice_cls}"), f"stream choice fields {stream_fields}")
    rng = fx.rng()
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

    def choice(cls: str, last: bool, token_ids: list[int]) -> dict[str, Any]:
        """Choice objects (``stop_reason``, 0.33 only, is always None here, as undeclared fields are)."""
        values = {
            "index": 0,
            "finish_reason": finish if last else None,
            "token_ids": token_ids,
            "routed_experts": b64 if last else None,
        }
        return dump_model(proto, cls, values)

    if not stream:
        resp: dict[str, Any] = {
            "request_id": f"gen-{version}",
            "choices": [choice(choice_cls, True, toks[p:].tolist())],
        }
        if new:
            resp |= {"prompt_token_ids": toks[:p].tolist(), "output_mode": "tokens", "usage": vllm_usage(p, k)}
        fx.payload["response.json"] = dump_model(proto, resp_cls, resp)
        fx.files = {"request.json": "/inference/v1/generate request", "response.json": f"{resp_cls} (non-streamed)"}
    else:
        chunks = []
        for j in range(k):
            chunk: dict[str, Any] = {
                "request_id": f"gen-{version}",
                "choices": [choice(stream_choice_cls, j == k - 1, [int(toks[p + j])])],
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
    fx.cite(
        outproc,
        None,
        "routed_experts = concat of per-step chunks, only on the finished output (also for aborts).",
        {"concat_on_finish": outproc.line("if finished and self.routed_experts_chunks:")},
        "`routed_experts = np.concatenate(routed_experts_chunks)` only when finished; an abort "
        "after some steps is a finished output too -> partial rows [start, prompt + k - 1), finish_reason 'abort'",
    )
    fx.add(f"gen-{version}", ids, returned(p + k, start), toks)
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


for _name, _version, _stream, _abort, _start in (
    ("vllm-0.22.0-generate", "0.22.0", False, False, 3),
    ("vllm-0.24.0-generate-stream", "0.24.0", True, False, 0),
    ("vllm-0.33.0-generate", "0.33.0", False, False, 3),
    ("vllm-0.33.0-generate-stream", "0.33.0", True, False, 0),
    ("vllm-0.33.0-generate-abort", "0.33.0", False, True, 0),
):
    builder(_name, "vllm", _version, DEEPSEEK, "", stream=_stream, abort=_abort, start=_start)(_generate)


# ---- SGLang ----
def dump_sgl(src: SourceFile, cls: str, values: dict[str, Any]) -> dict[str, Any]:
    """``dump_model`` with the None-dropping of SGLang's own serializer for ``cls``."""
    return dump_model(src, cls, values, drop_none=src.popped_when_none(cls))


def sgl_usage(proto: SourceFile, prompt: int, completion: int) -> dict[str, Any]:
    values = {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
        "reasoning_tokens": 0,
    }
    return dump_model(proto, "UsageInfo", values)


class _SGLang(_Sources):
    """One SGLang version: finish reasons and routing encoding executed from its files, meta_info as it builds it."""

    def __init__(self, ctx: Ctx, fx: Fixture) -> None:
        super().__init__(ctx, fx)
        wheel, version = self.wheel, self.version
        self.detok = wheel.read("sglang/srt/managers/detokenizer_manager.py")
        self.tm = wheel.read("sglang/srt/managers/tokenizer_manager.py")
        self.batch = wheel.read("sglang/srt/managers/schedule_batch.py")
        self.io = wheel.read("sglang/srt/managers/io_struct.py")
        ns: dict[str, Any] = namespace(Union=Any, List=list, Optional=Any)
        finish_classes = ["BaseFinishReason", "FINISH_MATCHED_TOKEN", "FINISH_LENGTH", "FINISH_ABORT"]
        for cls in finish_classes:
            run_source(self.batch.definition(cls), ns, f"<sglang {version} {cls}>")
        self.finish = ns
        fx.use(
            self.batch,
            finish_classes,
            "Executed: finish_reason.to_json() dicts.",
            {"FINISH_ABORT": self.batch.line("class FINISH_ABORT")},
        )
        # 0.5.11+ encodes per request (None without routing); 0.5.7-0.5.10 encode a missing one as []
        if "_b64_encode_per_request" in self.detok.text:
            encoder, empty = "_b64_encode_per_request", "None"
            self._encode: Callable[[list[Any]], list[Any]] = load_def(self.detok, f"DetokenizerManager.{encoder}")
        else:
            encoder, empty = "_extract_routed_experts", "`[]` (empty list)"
            method = load_def(self.detok, f"DetokenizerManager.{encoder}")
            self._encode = lambda items: method(None, types.SimpleNamespace(routed_experts=items))
        fx.cite(
            self.detok,
            [f"DetokenizerManager.{encoder}"],
            "Executed: base64 of the raw int32 tensor bytes (pybase64 -> base64, same bytes), "
            "per request in the batch.",
            {"encode": self.detok.line(f"def {encoder}")},
            f"`{encoder}`: base64(tensor.numpy().tobytes()) -> flat raw "
            f"little-endian int32, no shape header; a request without routing becomes {empty}",
        )
        fx.cite(
            self.tm,
            ["TokenizerManager._handle_batch_output"],
            "meta_info keys and where routed_experts goes.",
            {"meta_info.routed_experts": self.tm.line('meta_info["routed_experts"] = ')},
            '`meta_info["routed_experts"]` set when the batch output has routing',
        )
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
            if not wheel.has(path):
                continue
            src = wheel.read(path)
            if "start_len=start_len" in src.text:
                start_used = True
                fx.cite(
                    src,
                    ["_maybe_collect_routed_experts / maybe_collect_routed_experts"],
                    "get_topk(..., start_len) -> rows [start_len, seqlen - 1).",
                    {"get_topk": src.line("start_len=start_len")},
                    "rows [routed_experts_start_len, seqlen - 1) (start_len honoured)",
                )
            elif "def maybe_collect_routed_experts" in src.text:
                fx.cite(
                    src,
                    ["SchedulerOutputProcessorMixin.maybe_collect_routed_experts"],
                    "get_routed_experts(req_pool_idx, seqlen) with no start: rows [0, seqlen - 1).",
                    {"get_routed_experts": src.line("seqlen=req.seqlen,", after="def maybe_collect_routed_experts")},
                    "rows [0, seqlen - 1): the capturer reads req_to_token[:seqlen - 1] "
                    "(KV slots: radix-cache hits filled); no start offset",
                )
        self.start_len_honoured = start_used
        if self.has_start_len:
            fx.fact(
                self.io,
                self.io.line("routed_experts_start_len: int = 0"),
                "`GenerateReqInput.routed_experts_start_len` declared"
                + ("" if start_used else " but NEVER read by the scheduler in this version (silently ignored)"),
            )

    def openai(self, serving: str) -> tuple[SourceFile, SourceFile]:
        """The OpenAI protocol and ``serving_<serving>.py``."""
        base = "sglang/srt/entrypoints/openai"
        return self.wheel.read(f"{base}/protocol.py"), self.wheel.read(f"{base}/serving_{serving}.py")

    def encode(self, rows: npt.NDArray[np.int32] | None) -> Any:
        return self._encode([None if rows is None else TensorLike(rows)])[0]

    def finish_json(self, kind: str, value: Any = None) -> dict[str, Any]:
        if kind == "length":
            return dict(self.finish["FINISH_LENGTH"](value).to_json())
        if kind == "token":
            return dict(self.finish["FINISH_MATCHED_TOKEN"](value).to_json())
        return dict(self.finish["FINISH_ABORT"]().to_json())

    def meta(
        self, rid: str, finish: dict[str, Any], p: int, r: int, cached: int, routed: Any, indexer: Any = None
    ) -> dict[str, Any]:
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
        if indexer is not None:
            meta["indexer_topk"] = indexer
        meta["e2e_latency"] = 0.5
        return meta

    def routed_meta(
        self,
        rid: str,
        finish: dict[str, Any],
        ids: IntArray,
        p: int,
        cached: int,
        start: int = 0,
        indexer: npt.NDArray[np.int32] | None = None,
    ) -> dict[str, Any]:
        """meta_info of a finished request of ``len(ids)`` tokens (prompt ``p``) with rows [start, n - 1), and
        ``indexer`` (SGLang's indexer-topk rows) encoded as ``indexer_topk`` when given."""
        rows = captured_rows(ids, self.fx.spec, np.int32, start)
        encoded = None if indexer is None else self.encode(indexer)
        return self.meta(rid, finish, p, ids.shape[0] - p, cached, self.encode(rows), encoded)

    def generated(self, text: str, toks: IntArray, p: int, meta: dict[str, Any]) -> dict[str, Any]:
        """One /generate response object."""
        return {"text": text, "output_ids": toks[p:].tolist(), "meta_info": meta}


@builder("sglang-0.5.8-generate", "sglang", "0.5.8", DEEPSEEK)
def sglang_058_generate(ctx: Ctx, fx: Fixture) -> None:
    """SGLang 0.5.8 batched /generate (two input_ids lists): a list of two responses, meta_info.routed_experts = base64
    of raw int32, full decoder axis, rows [0, n - 1); the second prompt shares a 6-token radix-cache prefix (rows
    filled).
    """
    sg = _SGLang(ctx, fx)
    rng = fx.rng()
    shared = 6
    base_toks, base_ids = draw(rng, fx.spec, 20)
    responses, inputs = [], []
    for i, (p, r, finish) in enumerate(((9, 5, "length"), (10, 4, "token"))):
        if i:  # same first `shared` tokens as request 0: a radix-cache hit
            toks, ids = draw(rng, fx.spec, p + r - shared, after=(base_toks[:shared], base_ids[:shared]))
        else:
            toks, ids = base_toks[: p + r], base_ids[: p + r]
        inputs.append(toks[:p].tolist())
        fin = sg.finish_json(finish, r if finish == "length" else int(toks[-1]))
        meta = sg.routed_meta(f"sgl-058-{i}", fin, ids, p, shared if i else 0)
        responses.append(sg.generated("<detokenized>", toks, p, meta))
        fx.add(f"sgl-058-{i}", ids, returned(p + r), toks)
    fx.payload["request.json"] = {
        "input_ids": inputs,
        "sampling_params": {"max_new_tokens": 5, "temperature": 1.0},
        "return_routed_experts": True,
    }
    fx.payload["responses.json"] = responses
    fx.files = {"request.json": "batched /generate request", "responses.json": "the list /generate returns"}


def _sglang_turns(ctx: Ctx, fx: Fixture) -> None:
    """Two turns of one session; the description depends on whether the version honours the start length."""
    version = fx.version
    sg = _SGLang(ctx, fx)
    p1, r1, u, r2 = 8, 4, 5, 4
    t1 = p1 + r1
    p2 = t1 + u
    toks, ids = draw(fx.rng(), fx.spec, p2 + r2)
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
        meta = sg.routed_meta(f"sgl-turn{turn}", sg.finish_json("length", r), ids[:n], p, t1 if turn else 0, s_eff)
        responses.append(sg.generated("<detokenized>", toks[:n], p, meta))
        fx.add(f"session/turn{turn}", ids[:n], returned(n, s_eff), toks[:n])
    fx.payload["requests.json"] = requests
    fx.payload["responses.json"] = responses
    fx.files = {
        "requests.json": "the two /generate requests of one session (turn 1 resends turn 0's tokens + new "
        "user tokens, with routed_experts_start_len = len(turn-0 tokens) - 1)",
        "responses.json": "the two /generate responses",
    }
    if sg.start_len_honoured:
        fx.add("session/stitched", ids, returned(p2 + r2), toks)
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


for _name, _version in (
    ("sglang-0.5.8-generate-startlen-ignored", "0.5.8"),
    ("sglang-0.5.12-generate-multiturn", "0.5.12"),
):
    builder(_name, "sglang", _version, DEEPSEEK, "")(_sglang_turns)


@builder("sglang-0.5.9-completions", "sglang", "0.5.9", QWEN)
def sglang_059_completions(ctx: Ctx, fx: Fixture) -> None:
    """SGLang 0.5.9 OpenAI /v1/completions with n=2: response-level sglext.routed_experts (base64 raw int32) built from
    the FIRST result only; choice 1's routing is absent; choices carry no token ids.
    """
    spec = fx.spec
    sg = _SGLang(ctx, fx)
    proto, serving = sg.openai("completions")
    utils = sg.wheel.read("sglang/srt/entrypoints/openai/utils.py")
    pick = load_def(utils, "process_routed_experts_from_ret")
    fx.use(
        utils,
        ["process_routed_experts_from_ret"],
        "Executed: meta_info['routed_experts'] of one ret item.",
        {"def": utils.line("def process_routed_experts_from_ret")},
    )
    fx.cite(
        serving,
        None,
        "sglext from ret[0] only.",
        {"first_ret": serving.line("routed_experts = process_routed_experts_from_ret(first_ret, request)")},
        "OpenAI completions/chat: `sglext.routed_experts` (response level, key `sglext`) from "
        "the FIRST ret item only; other choices/prompts get no routing",
    )
    fx.cite(
        proto,
        ["SglExt", "CompletionResponse", "CompletionResponseChoice", "CompletionRequest"],
        "Field names and None-dropping serializers.",
        {"SglExt": proto.line("class SglExt")},
        "`SglExt` serializer drops None fields; responses drop `sglext` when None",
    )
    rng = fx.rng()
    p = 7
    prompt = draw(rng, spec, p)
    rets, choices = [], []
    for i, r in enumerate((4, 6)):
        toks, ids = draw(rng, spec, r, after=prompt)
        meta = sg.routed_meta(f"sgl-cmpl-{i}", sg.finish_json("length", r), ids, p, p if i else 0)
        rets.append({"meta_info": meta})
        choice = {"index": i, "text": "<detokenized>", "finish_reason": "length", "matched_stop": None}
        choices.append(dump_sgl(proto, "CompletionResponseChoice", choice))
        fx.add(f"sgl-cmpl/{i}", ids, returned(p + r) if i == 0 else np.zeros(p + r, bool), toks)
    routed = pick(rets[0], types.SimpleNamespace(return_routed_experts=True))
    sglext = {} if routed is None else {"routed_experts": routed}  # SglExt drops None fields
    fx.payload["request.json"] = {
        "model": spec.name,
        "prompt": prompt[0].tolist(),
        "max_tokens": 6,
        "n": 2,
        "return_routed_experts": True,
    }
    fx.payload["response.json"] = openai_response(
        proto, False, "sgl-cmpl", spec, choices, sgl_usage(proto, p, 10), dump=dump_sgl, sglext=sglext
    )
    fx.notes = {
        "1": {"routing_absent": True, "why": "sglext.routed_experts comes from ret[0] only"},
        "token_ids": "the response has no token ids: prompt from the request, output lengths only from "
        "the routing row count (choice 0) / usage",
    }
    fx.files = {"request.json": "/v1/completions request (n=2)", "response.json": "CompletionResponse (SGLang 0.5.9)"}


@builder("sglang-0.5.23-chat-metainfo", "sglang", "0.5.23", DEEPSEEK)
def sglang_0523_chat(ctx: Ctx, fx: Fixture) -> None:
    """SGLang 0.5.23 /v1/chat/completions with return_meta_info and return_token_ids: routing in
    choices[i].meta_info.routed_experts (per choice, base64 int32), sglext.routed_experts suppressed; choices carry
    prompt_token_ids and response_token_ids.
    """
    spec = fx.spec
    sg = _SGLang(ctx, fx)
    proto, serving = sg.openai("chat")
    none_line = serving.line("if request.return_meta_info", after="first_ret = ret[0]")
    fx.cite(
        serving,
        None,
        "meta_info per choice when return_meta_info; "
        "sglext.routed_experts None then; prompt_token_ids / response_token_ids with return_token_ids.",
        {
            "choice.meta_info": serving.line('ret_item["meta_info"] if request.return_meta_info else None'),
            "sglext_suppressed": none_line,
            "response_token_ids": serving.line('ret_item["output_ids"] if request.return_token_ids else None'),
        },
        "chat with `return_meta_info`: `choices[i].meta_info` = the /generate meta_info "
        "(routed_experts inside, per choice); `sglext.routed_experts` is None (line "
        f"{none_line}); `choices[i].prompt_token_ids`, `choices[i].response_token_ids` need return_token_ids",
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
    rng = fx.rng()
    p = 10
    prompt = draw(rng, spec, p)
    choices = []
    for i, r in enumerate((5, 3)):
        toks, ids = draw(rng, spec, r, after=prompt)
        choice = {
            "index": i,
            "message": dump_sgl(proto, "ChatMessage", {"role": "assistant", "content": "<detokenized>"}),
            "finish_reason": "length",
            "matched_stop": None,
            "prompt_token_ids": toks[:p].tolist(),
            "response_token_ids": toks[p:].tolist(),
            "meta_info": sg.routed_meta(f"sgl-chat-{i}", sg.finish_json("length", r), ids, p, p if i else 0),
        }
        choices.append(dump_sgl(proto, "ChatCompletionResponseChoice", choice))
        fx.add(f"sgl-chat/{i}", ids, returned(p + r), toks)
    fx.payload["request.json"] = chat_request(
        spec, n=2, max_tokens=5, return_routed_experts=True, return_meta_info=True, return_token_ids=True
    )
    fx.payload["response.json"] = openai_response(
        proto, True, "sgl-chat", spec, choices, sgl_usage(proto, p, 8), dump=dump_sgl
    )
    fx.files = {"request.json": "chat request", "response.json": "ChatCompletionResponse (SGLang 0.5.23)"}


@builder("sglang-0.5.23-generate-abort", "sglang", "0.5.23", DEEPSEEK)
def sglang_0523_abort(ctx: Ctx, fx: Fixture) -> None:
    """SGLang 0.5.23 /generate aborts: [0] aborted while running (FINISH_ABORT -> finish_reason {type: abort, message:
    Aborted, ...}; routing collected like any finish, rows [0, n - 1)); [1] aborted in the waiting queue (no
    routed_experts key, no output).
    """
    spec = fx.spec
    sg = _SGLang(ctx, fx)
    fx.cite(
        sg.tm,
        None,
        "queued abort: meta_info {id, finish_reason, completion_tokens} only.",
        {"queued_abort": sg.tm.line('abort_message = recv_obj.abort_message or "Abort in waiting queue"')},
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
    rng = fx.rng()
    p, r = 8, 3
    toks, ids = draw(rng, spec, p + r)
    running = sg.generated("<partial>", toks, p, sg.routed_meta("sgl-abort-0", sg.finish_json("abort"), ids, p, 0))
    fx.add("sgl-abort-0", ids, returned(p + r), toks)
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


# ---- SGLang: the DSA indexer's top-k (0.5.23, `--enable-return-indexer-topk`) ----
SGL_KV_SLOTS = 64
"""KV-pool slots of the simulated server: a request's tokens get scattered slots, read back by slot."""


class _HostTensor(np.ndarray):  # type: ignore[type-arg]
    """A numpy array answering the torch calls SGLang's capturer makes on CPU tensors (``.cpu()``, ``.clone()``)."""

    def cpu(self) -> _HostTensor:
        return self

    def clone(self) -> _HostTensor:
        return self.copy()


class _SGLangIndexer:
    """SGLang's indexer-topk capture executed from its source against numpy buffers: the layer slots and which layers
    reuse the previous layer's selection (``configs/model_config.py``), each layer's capture into the device buffer,
    a reusing layer mirroring the previous layer's indices (``maybe_capture_indexer_topk``,
    ``BaseDeviceCache.capture``), the copy into the zeroed int32 host buffer by KV slot after each forward
    (``BaseTopkCapturer.on_forward_end``) and a finished request's read-back (``BaseTopkCapturer.get_topk``)."""

    def __init__(self, sg: _SGLang) -> None:
        fx, wheel, spec = sg.fx, sg.wheel, sg.fx.spec
        assert spec.indexer is not None
        config_src = wheel.read("sglang/srt/configs/model_config.py")
        names = ["_hf_arch", "_hf_attr", "is_deepseek_dsa", "is_deepseek_v4", "dsa_layer_skips_topk"]
        ns = namespace(Optional=Any, PretrainedConfig=Any)
        for name in [*names, "get_num_indexer_layers"]:
            run_source(config_src.definition(name), ns, f"<sglang {fx.version} {name}>")
        config = types.SimpleNamespace(**spec.hf_config)
        self.slots: int = ns["get_num_indexer_layers"](config)
        self.skips = [bool(ns["dsa_layer_skips_topk"](config, i)) for i in range(spec.num_layers)]
        shared = [i for i, skip in enumerate(self.skips) if skip]
        if self.slots != spec.num_layers or shared != spec.indexer["shared"]:
            raise SystemExit(f"{fx.name}: SGLang gives {self.slots} slots, shared layers {shared}; the spec disagrees")
        fx.cite(
            config_src,
            [*names, "get_num_indexer_layers"],
            "Executed: slots and reusing layers of the fixture's HF config.",
            {
                "num_hidden_layers": config_src.line(
                    "return config.num_hidden_layers", after="def get_num_indexer_layers"
                ),
                "dsa_layer_skips_topk": config_src.line("def dsa_layer_skips_topk"),
            },
            "`get_num_indexer_layers`: a DSA model (V3.2, GLM) gets one indexer-topk slot per decoder layer "
            "(num_hidden_layers), layers that reuse the previous layer's top-k included (`dsa_layer_skips_topk`: "
            "indexer_types, cli_factor, index_topk_pattern, index_topk_freq / index_skip_topk_offset)",
        )
        mla = wheel.read("sglang/srt/models/deepseek_common/attention_forward_methods/forward_mla.py")
        fx.cite(
            mla,
            None,
            "A layer that skips top-k mirrors prev_topk_indices into its own slot.",
            {"mirror": mla.line("self.layer_id, prev_topk_indices")},
            "a layer reusing the previous layer's top-k captures `prev_topk_indices` into its own slot "
            "(`maybe_capture_indexer_topk(self.layer_id, prev_topk_indices)`): the payload is dense over all layers",
        )
        self.k = int(spec.indexer["index_topk"])
        base = wheel.read("sglang/srt/state_capturer/base.py")
        capture = load_def(base, "BaseDeviceCache.capture")
        local_slice = load_def(base, "BaseTopkCapturer._get_local_slice")
        self._on_forward_end = load_def(base, "BaseTopkCapturer.on_forward_end")
        self._get_topk = load_def(base, "BaseTopkCapturer.get_topk")
        fx.cite(
            base,
            [
                "BaseDeviceCache.capture",
                "BaseTopkCapturer._get_local_slice",
                "BaseTopkCapturer.on_forward_end",
                "BaseTopkCapturer.get_topk",
                "BaseHostCache",
            ],
            "Executed: capture into the device buffer, host copy by KV slot, read-back of rows [0, seqlen - 1).",
            {
                "get_topk": base.line("req_to_token_pool.req_to_token[req_pool_idx][start_len : seqlen - 1]"),
                "host_copy": base.line("self.host_cache.buffer[out_cache_loc_cpu] = slice_gpu.cpu()"),
                "host_zeroed": base.line("self.buffer.zero_()"),
            },
            "int32 host buffer indexed by KV slot (zeroed at start: a slot never written reads as zeros); "
            "`get_topk` reads `req_to_token[req][start_len : seqlen - 1]`: rows [0, n - 1), radix-cache hits filled",
        )
        self.device = types.SimpleNamespace(buffer=np.zeros((SGL_KV_SLOTS, self.slots, self.k), np.int32))
        self.host = np.zeros((SGL_KV_SLOTS, self.slots, self.k), np.int32)
        self.device.buffer = self.device.buffer.view(_HostTensor)
        self.capturer = types.SimpleNamespace(
            device_cache=self.device, topk_size=self.k, host_cache=types.SimpleNamespace(buffer=self.host)
        )
        self.capturer._get_local_slice = functools.partial(local_slice, self.capturer)
        sink = types.SimpleNamespace(
            capture=lambda layer_id, topk_indices: capture(self.device, layer_id, topk_indices)
        )
        topk_src = wheel.read("sglang/srt/state_capturer/indexer_topk.py")
        self._maybe_capture = load_def(topk_src, "maybe_capture_indexer_topk", get_global_indexer_capturer=lambda: sink)
        fx.cite(
            topk_src,
            ["maybe_capture_indexer_topk", "extract_indexer_topk_from_meta_info"],
            "Executed: maybe_capture_indexer_topk; the decoder's shape.",
            {"reshape": topk_src.line("Caller reshapes to (seqlen-1, num_indexer_layers,")},
            '`meta_info["indexer_topk"]`: base64 of raw int32, no header, shape (seqlen - 1, num_indexer_layers, '
            "index_topk)",
        )
        processor = wheel.read("sglang/srt/managers/scheduler_components/batch_result_processor.py")
        collect = processor.definition("SchedulerBatchResultProcessor._maybe_collect_indexer_topk")
        if "start_len" in collect:
            raise SystemExit(f"{fx.name}: _maybe_collect_indexer_topk now passes a start")
        fx.cite(
            processor,
            ["SchedulerBatchResultProcessor._maybe_collect_indexer_topk"],
            "get_topk without start_len.",
            {"collect": processor.line("def _maybe_collect_indexer_topk")},
            "indexer rows are always [0, seqlen - 1): `get_topk` is called without `start_len` "
            "(`routed_experts_start_len` shapes the routing only)",
        )
        fx.cite(
            sg.tm,
            None,
            "meta_info key.",
            {"meta_info.indexer_topk": sg.tm.line('meta_info["indexer_topk"] = val')},
            '`meta_info["indexer_topk"]` set after `routed_experts`, encoded like it (`_b64_encode_per_request`)',
        )
        fx.cite(
            sg.io,
            ["GenerateReqInput"],
            "request field.",
            {"return_indexer_topk": sg.io.line("return_indexer_topk: bool = False")},
            "`GenerateReqInput.return_indexer_topk` (server `--enable-return-indexer-topk`); the OpenAI protocol "
            "has no such field",
        )
        dsa = wheel.read("sglang/srt/layers/attention/dsa/dsa_indexer.py")
        backend = wheel.read("sglang/srt/layers/attention/dsa/dsa_topk_backend.py")
        environ = wheel.read("sglang/srt/environ.py")
        fx.cite(
            dsa,
            None,
            "What the captured top-k holds.",
            {
                "logical": dsa.line("expects logical positions"),
                "fast_path": dsa.line(
                    "When length <= 2048, naive_topk_cuda directly generates [0,1,...,length-1,-1,...]"
                ),
            },
            "the capture sites take the indexer's output after `metadata.topk_transform`: with the top-k unfused "
            "(SGLANG_DSA_FUSE_TOPK=0) these are positions within the request ([0..t, -1, ...] while t + 1 <= "
            "index_topk, else index_topk positions in the kernel's order); fused (the default) they are KV-pool slots "
            "(decode) or offsets into the batch's ragged KV (prefill). The fixture holds positions",
        )
        fx.use(
            backend,
            ["DSATopKBackend.topk_transform"],
            "unfused top-k when SGLANG_DSA_FUSE_TOPK is off.",
            {"unfused": backend.line("if not envs.SGLANG_DSA_FUSE_TOPK.get() or force_unfused_topk:")},
        )
        fx.use(
            environ,
            [],
            "default of SGLANG_DSA_FUSE_TOPK.",
            {"default": environ.line("SGLANG_DSA_FUSE_TOPK = EnvBool(True)")},
        )

    def forward(self, kv_slots: IntArray, picks: npt.NDArray[np.int32]) -> None:
        """One forward of tokens at ``kv_slots``; ``picks`` ``[tokens, computing layers, k]`` their indexer top-k."""
        computing = iter(range(picks.shape[1]))
        prev = None
        for layer, skip in enumerate(self.skips):
            prev = self._maybe_capture(layer, prev if skip else picks[:, next(computing)])
        batch = types.SimpleNamespace(out_cache_loc=np.asarray(kv_slots).view(_HostTensor), out_cache_loc_virtual=None)
        self._on_forward_end(self.capturer, batch, False, None)

    def rows(self, kv_slots: IntArray, seqlen: int) -> npt.NDArray[np.int32]:
        """What ``get_topk`` returns for a finished request whose tokens sit at ``kv_slots``."""
        pool = types.SimpleNamespace(req_to_token=np.asarray(kv_slots)[None].view(_HostTensor))
        return np.asarray(self._get_topk(self.capturer, req_pool_idx=0, seqlen=seqlen, req_to_token_pool=pool))


def indexer_picks(rng: np.random.Generator, first: int, stop: int, layers: int, k: int) -> npt.NDArray[np.int32]:
    """``[stop - first, layers, k]``: the indexer's top-k of the queries at positions ``first..stop-1`` as positions
    (unfused): ``[0..t, -1, ...]`` while ``t + 1 <= k``, else ``k`` distinct positions of ``[0, t]`` in score order."""
    out = np.full((stop - first, layers, k), -1, np.int32)
    for i, t in enumerate(range(first, stop)):
        for j in range(layers):
            out[i, j, : min(k, t + 1)] = np.arange(t + 1) if t + 1 <= k else np.argsort(-rng.random(t + 1))[:k]
    return out


def canonical_indexer(picks: npt.NDArray[np.int32]) -> npt.NDArray[np.int32]:
    """routelog's rows of ``picks`` (the forwarded tokens): each ascending, -1 last, then a -1 row for the final
    token, never forwarded."""
    rows = np.sort(picks.view(np.uint32), axis=-1).view(np.int32)  # -1 = 0xFFFFFFFF sorts last
    return np.concatenate([rows, np.full((1, *rows.shape[1:]), -1, np.int32)])


def _sglang_indexer(ctx: Ctx, fx: Fixture, *, multiturn: bool) -> None:
    """Requests run through the executed capture; each reuses ``cached`` KV slots of the request before it."""
    spec = fx.spec
    assert spec.indexer is not None
    sg = _SGLang(ctx, fx)
    dsa = _SGLangIndexer(sg)
    rng = fx.rng()
    if multiturn:  # turn 1 resends turn 0's tokens + 5 user tokens, routed_experts_start_len = len(turn 0) - 1
        t1 = 12
        toks, ids = draw(rng, spec, t1 + 5 + 4)
        plan = [(toks[:t1], ids[:t1], 8, 0, 0), (toks, ids, t1 + 5, t1 - 1, t1 - 1)]
    else:  # request 1 shares a 6-token radix-cache prefix with request 0
        toks0, ids0 = draw(rng, spec, 15)
        toks1, ids1 = draw(rng, spec, 8, after=(toks0[:6], ids0[:6]))
        plan = [(toks0, ids0, 9, 0, 0), (toks1, ids1, 10, 6, 0)]
    free = iter(rng.permutation(SGL_KV_SLOTS).tolist())
    slots: IntArray = np.zeros(0, np.int64)
    picks = np.zeros((0, len(spec.indexer["layers"]), dsa.k), np.int32)
    requests, responses = [], []
    for i, (tk, route, p, cached, start) in enumerate(plan):
        n = tk.shape[0]
        slots = np.concatenate([slots[:cached], [next(free) for _ in range(n - cached)]]).astype(np.int64)
        picks = np.concatenate([picks[:cached], indexer_picks(rng, cached, n - 1, picks.shape[1], dsa.k)])
        dsa.forward(slots[cached:p], picks[cached:p])  # prefill of the prompt past the cached prefix
        for t in range(p, n - 1):  # a decode step per generated token but the last
            dsa.forward(slots[t : t + 1], picks[t : t + 1])
        rows = dsa.rows(slots, n)
        layers = spec.indexer["layers"]
        assert np.array_equal(rows[:, layers], picks)
        rid = f"sgl-dsa-{i}"
        meta = sg.routed_meta(rid, sg.finish_json("length", n - p), route, p, cached, start, indexer=rows)
        responses.append(sg.generated("<detokenized>", tk, p, meta))
        request: dict[str, Any] = {
            "input_ids": tk[:p].tolist(),
            "sampling_params": {"max_new_tokens": n - p},
            "return_routed_experts": True,
            "return_indexer_topk": True,
        }
        if start:
            request["routed_experts_start_len"] = start
        requests.append(request)
        fx.add(rid, route, returned(n, start), tk, canonical_indexer(picks))
    if multiturn:
        fx.payload["requests.json"] = requests
        fx.files = {
            "requests.json": "two turns of one session (turn 1: routed_experts_start_len = len(turn 0) - 1)",
            "responses.json": "the two /generate responses (indexer_topk rows [0, n - 1) in both)",
        }
    else:
        fx.payload["request.json"] = {**requests[0], "input_ids": [r["input_ids"] for r in requests]}
        fx.files = {"request.json": "batched /generate request", "responses.json": "the list /generate returns"}
    fx.payload["responses.json"] = responses
    fx.notes = {
        "indexer": "expected.npz <i>_indexer: routelog's rows [n, computing layers, index_topk] (sorted, -1 last, "
        "final row -1); the payload holds every decoder layer, reusing layers a copy, rows in the kernel's order",
        "coordinates": "positions within the request: SGLang 0.5.23 with SGLANG_DSA_FUSE_TOPK=0 (the default fused "
        "transform returns KV-pool slots)",
    }


variants(
    _sglang_indexer,
    "sglang",
    (
        "sglang-0.5.23-generate-indexer-glm-dsa",
        "0.5.23",
        GLM_DSA,
        "SGLang 0.5.23 batched /generate of a GLM-5-like DSA model (layers 2 and 4 reuse layers 1 and 3's indexer "
        "top-k) with return_indexer_topk: meta_info.indexer_topk = base64 raw int32 [n - 1, num_hidden_layers, "
        "index_topk], reusing layers a copy of their source, rows in the kernel's order, -1 padded; request 1 hits "
        "request 0's 6-token radix-cache prefix (its rows read back by KV slot).",
        {"multiturn": False},
    ),
    (
        "sglang-0.5.23-generate-indexer-v32",
        "0.5.23",
        V32,
        "SGLang 0.5.23 two-turn /generate of a DeepSeek-V3.2-like model with return_indexer_topk: turn 1 sends "
        "routed_experts_start_len, which shapes routed_experts only; indexer_topk holds rows [0, n - 1) in both turns.",
        {"multiturn": True},
    ),
)


# ---- trainer-side layouts and forks ----
@builder("verl-0.9.1-batch", "verl", "0.9.1", DEEPSEEK)
def verl_batch(ctx: Ctx, fx: Fixture) -> None:
    """veRL 0.9.1 agent-loop batch: routed_experts [B, prompt_length + response_length, L, K] int16, engine rows (vLLM
    0.24 in-process: full axis, n - 1 rows) written from the left-padding offset; padding and the final token are
    zeros.
    """
    spec = fx.spec
    wheel = ctx.wheel("verl", "0.9.1")
    loop = wheel.read("verl/experimental/agent_loop/agent_loop.py")
    # (key, asserted source text, fact stated about that line or None)
    asserted: tuple[tuple[str, str, str | None], ...] = (
        ("int16", "experts_tensor = experts_tensor.to(torch.int16)", "cast to int16"),
        ("zeros", "routed_experts = torch.zeros(1, total_length, layer_num, topk_num", None),
        (
            "start_pos",
            'start_pos = prompt_output["input_ids"].shape[1] - len(output.prompt_ids)',
            "start_pos = padded prompt length - prompt length "
            "(left padding); rows = engine rows (n - 1), so the last response token's row stays 0",
        ),
        ("write", "routed_experts[:, start_pos:end_pos] = experts_tensor.unsqueeze(0)", None),
        ("left_pad", 'padding_side="left"', None),
        (
            "concat",
            'optional_outputs["routed_experts"] = torch.cat(',
            "batch tensor = cat over samples: [B, prompt_length + response_length, L, K]",
        ),
    )
    lines = {key: loop.line(needle) for key, needle, _ in asserted}
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
    for key, _, fact in asserted:
        if fact is not None:
            fx.fact(loop, lines[key], fact)
    rng = fx.rng()
    p_max, r_max = 12, 6
    batch_routes, mask, input_ids, response_mask = [], [], [], []
    for i, (p, r) in enumerate(((9, 6), (12, 3), (5, 5))):
        toks, ids = draw(rng, spec, p + r)
        engine = captured_rows(ids, spec, np.uint8)
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
        fx.add(f"verl/{i}", ids, returned(p + r), toks)
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


@builder("slime-sample", "slime", "THUDM/slime main", DEEPSEEK)
def slime_sample(ctx: Ctx, fx: Fixture) -> None:
    """slime Sample.rollout_routed_experts: int32 [len(tokens) - 1, num_layers, moe_router_topk] (SGLang's full axis);
    sample 1 is multi-turn: the first start_len rows kept, the turn's new rows appended.
    """
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
    rng = fx.rng()
    arrays: dict[str, Any] = {}
    for sid, p, r in (("slime/0", 9, 5), ("slime/1", 14, 4)):
        toks, ids = draw(rng, fx.spec, p + r)
        rows = captured_rows(ids, fx.spec, np.int32)
        if sid == "slime/1":
            start = 10
            first_turn = rows[:start]  # from turn 1 (tokens[:11])
            new = rows[start:]  # turn 2 response with routed_experts_start_len=10
            rows = np.concatenate([first_turn[:start], new])
        arrays[f"{sid}/rollout_routed_experts"] = rows
        arrays[f"{sid}/tokens"] = toks
        arrays[f"{sid}/response_length"] = np.asarray(r)
        fx.add(sid, ids, returned(p + r), toks)
    fx.payload["samples.npz"] = arrays
    fx.files = {
        "samples.npz": "<sample_id>/rollout_routed_experts (int32), <sample_id>/tokens, <sample_id>/response_length"
    }


@builder("ms-swift-4.6.0-chat", "ms-swift", "4.6.0", DEEPSEEK)
def ms_swift_chat(ctx: Ctx, fx: Fixture) -> None:
    """ms-swift 4.6.0 rollout server chat response: choices[i].routed_experts = serialize_ndarray(vLLM
    CompletionOutput.routed_experts) = {data: base64 raw bytes, shape, dtype, __ndarray__: true}; with vLLM 0.23
    (ms-swift's recommended version) that is uint8, full axis, rows [0, n - 1) INCLUDING the prompt rows.
    """
    spec = fx.spec
    wheel = ctx.wheel("ms-swift", "4.6.0")
    proto = wheel.read("swift/infer_engine/protocol.py")
    engine = wheel.read("swift/infer_engine/grpo_vllm_engine.py")
    serialize = load_def(proto, "serialize_ndarray")
    fx.cite(
        proto,
        ["serialize_ndarray", "ChatCompletionResponseChoice", "ChatCompletionResponse"],
        "Executed: serialize_ndarray; field names.",
        {
            "serialize_ndarray": proto.line("def serialize_ndarray"),
            "routed_experts": proto.line("routed_experts: Optional[NumpyArray]"),
        },
        "`{'data': b64(arr.tobytes()), 'shape', 'dtype': "
        "str(dtype), '__ndarray__': True}` in `choices[i].routed_experts`",
    )
    fx.cite(
        engine,
        None,
        "routed_experts = getattr(output, 'routed_experts', None) from vLLM.",
        {"getattr": engine.line("routed_experts=getattr(output, 'routed_experts', None))")},
        "the array is vLLM's "
        "CompletionOutput.routed_experts as is: prompt rows included for vLLM >= 0.22 (generation rows only "
        "with 0.21, whose prompt rows live on RequestOutput and are dropped)",
    )
    v23 = ctx.wheel("vllm", "0.23.0").read(VLLM_CAPTURER)
    rule = vllm_dtype_rule(v23)
    fx.use(v23, [rule.owner], f"vLLM 0.23.0 dtype rule `{rule.expr}`.", {"dtype": rule.line})
    p, r = 8, 5
    toks, ids = draw(fx.rng(), spec, p + r)
    payload = serialize(captured_rows(ids, spec, rule.dtype_of(spec.num_experts)))
    payload["shape"] = list(payload["shape"])
    message = {"role": "assistant", "content": "<detokenized>", "tool_calls": None, "reasoning_content": None}
    choice = {
        "index": 0,
        "message": message,
        "finish_reason": "length",
        "logprobs": None,
        "token_ids": toks[p:].tolist(),
        "routed_experts": payload,
    }
    envelope = openai_envelope(
        True, "chatcmpl-swift", spec, [dump_model(proto, "ChatCompletionResponseChoice", choice)], plain_usage(p, r)
    )
    # the dataclass declares only some of the OpenAI fields (which ones depends on the ms-swift version)
    resp_fields = proto.fields("ChatCompletionResponse")
    values = {k: v for k, v in (envelope | {"prompt_token_ids": toks[:p].tolist()}).items() if k in resp_fields}
    fx.payload["response.json"] = dump_model(proto, "ChatCompletionResponse", values)
    fx.add("chatcmpl-swift", ids, returned(p + r), toks)
    fx.files = {"response.json": "ChatCompletionResponse dataclass as JSON (ms-swift 4.6.0)"}


@builder("nemo-rl-chat", "nemo-rl", "NVIDIA-NeMo/RL main (vLLM 0.25.1)", DEEPSEEK)
def nemo_rl_chat(ctx: Ctx, fx: Fixture) -> None:
    """NeMo-RL OpenAI chat server: choices[i].message.routed_experts = 'nrlre1:<dtype>:<S>x<L>x<K>:<base64>' over all S
    = n tokens (vLLM's axis); rows vLLM did not return are -1; the final row is the dummy arange(K). Response [1]
    had 3 rows missing (incomplete vLLM output).
    """
    spec = fx.spec
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
    # vLLM's own rows; the scratch fixture only absorbs _V022Plus's provenance records
    vllm = _V022Plus(ctx, Fixture("scratch", "vllm", "0.25.1", spec, ""))
    rng = fx.rng()
    dtype = np.int8 if spec.num_experts <= 128 else np.int16
    responses = []
    for i, (p, r, missing) in enumerate(((7, 4, 0), (8, 5, 3))):
        toks, ids = draw(rng, spec, p + r)
        n = p + r
        returned_rows = vllm.rows(ids, spec, 0)[: n - 1 - missing]
        full = np.broadcast_to(np.arange(spec.topk), (n, spec.num_layers, spec.topk)).astype(dtype).copy()
        full[: returned_rows.shape[0]] = returned_rows.astype(dtype)
        full[returned_rows.shape[0] : n - 1] = -1
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
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": "length", "stop_reason": None}
        responses.append(openai_envelope(True, f"chatcmpl-nrl{i}", spec, [choice], plain_usage(p, r)))
        fx.add(f"chatcmpl-nrl{i}", ids, span(n, 0, n - 1 - missing), toks)
    fx.payload["responses.json"] = responses
    fx.notes = {"1": {"missing_rows": [12 - 3, 12], "sentinel": -1}, "final_row": "dummy arange(K), never valid"}
    fx.files = {"responses.json": "two chat responses (vLLM ChatCompletionResponse + NeMo-RL message fields)"}


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
