"""Sizes read from storage or a payload are bounded before anything is allocated; hostile input gets a typed error.

Each bomb claims far more than it holds (a chunk of 2**31 rows, a record of 2**31 tokens, a 32 KB zstd frame of
1 GiB, an ``.npy`` header of 10**12 elements, JSON nested 100 000 deep); the peak memory a refusal allocates is
measured with ``tracemalloc`` and must stay a small multiple of the bytes actually present.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import tracemalloc
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from numcodecs import Zstd

import routelog
from routelog import keys
from routelog.engines import sglang, vllm
from routelog.errors import (
    CorruptDataError,
    FormatVersionError,
    GcRefusedError,
    IngestError,
    ModelSpecError,
)
from routelog.format import RoutingArrayInfo
from routelog.gc import collect_garbage
from routelog.ingest import load_arrays, read_records
from routelog.part import shard_layout
from routelog.shard import _crc
from routelog.spec import ModelSpec
from routelog.storage import Storage
from routelog.verify import verify_store
from tests.attacks.kit import SPEC, build_store, read_everything

PEAK_LIMIT = 32 << 20
"""Bytes any single refusal below may allocate (the stores and payloads are a few KB to 1 MB)."""


@contextmanager
def bounded_allocation() -> Iterator[None]:
    tracemalloc.start()
    try:
        yield
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < PEAK_LIMIT, f"allocated {peak} bytes to refuse a bomb"


def _first_commit(storage: Storage) -> tuple[str, dict[str, Any]]:
    key = keys.commit_key(0, storage.list(keys.commits_dir(0))[0])
    return key, json.loads(storage.read(key))


def _replace_object(storage: Storage, commit_key: str, commit: dict[str, Any], name: str, data: bytes) -> None:
    """Overwrite one object of a part and re-list it in the commit, so only the bomb itself is wrong."""
    storage.write(f"{keys.part_dir(0, commit['part'])}/{name}", data)
    for obj in commit["objects"]:
        if obj["key"] == name:
            obj.update(size=len(data), sha256=hashlib.sha256(data).hexdigest())
    storage.write(commit_key, json.dumps(commit).encode())


# -- storage-side bombs ----------------------------------------------------------------------------------------------
def _unsealed_store_with_first_commit(url: str, field: str, value: Any) -> None:
    """A store whose first commit document has ``field`` (dotted) set to ``value``."""
    build_store(url, sealed=False)
    storage = routelog.open_store(url).storage
    key, commit = _first_commit(storage)
    *path, last = field.split(".")
    target = commit
    for name in path:
        target = target[name]
    target[last] = value
    storage.write(key, json.dumps(commit).encode())


def test_a_commit_claiming_huge_chunks_is_refused(memory_url: str) -> None:
    _unsealed_store_with_first_commit(memory_url, "routing.chunk_rows", 2**31)
    with bounded_allocation(), pytest.raises(CorruptDataError, match="chunk"):
        read_everything(memory_url)


def test_an_index_row_claiming_two_billion_tokens_is_refused(memory_url: str) -> None:
    build_store(memory_url, sealed=False)
    storage = routelog.open_store(memory_url).storage
    key, commit = _first_commit(storage)
    index_key = f"{keys.part_dir(0, commit['part'])}/{keys.INDEX}"
    table = pq.read_table(io.BytesIO(storage.read(index_key)))
    rows = table.to_pylist()
    rows[0]["n_tokens"] = rows[0]["prompt_len"] = 2**31 - 1 - rows[0]["response_len"]
    rows[0]["token_ids"] = None
    sink = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows, schema=table.schema), sink)
    commit["n_tokens"] = sum(r["n_tokens"] for r in rows)
    _replace_object(storage, key, commit, keys.INDEX, sink.getvalue())
    with bounded_allocation(), pytest.raises(CorruptDataError, match=r"n_tokens|less than or equal"):
        read_everything(memory_url)


def test_a_zstd_frame_expanding_to_a_gibibyte_is_refused(memory_url: str) -> None:
    build_store(memory_url, sealed=False)
    storage = routelog.open_store(memory_url).storage
    key, commit = _first_commit(storage)
    info = RoutingArrayInfo.model_validate(commit["routing"])
    layout_ = shard_layout(info)
    name = f"{info.path}/{layout_.shard_key()}"
    shard = storage.read(f"{keys.part_dir(0, commit['part'])}/{name}")
    bomb = bytes(Zstd(level=1).encode(np.zeros(1 << 30, dtype=np.uint8)))
    piece = bomb + _crc(bomb)
    n = layout_.index_nbytes
    index = np.frombuffer(shard[: n - 4], dtype="<u8").reshape(-1, 2).copy()
    first_offset, first_size = int(index[0, 0]), int(index[0, 1])
    rest = shard[first_offset + first_size :]
    index[1:, 0] += len(piece) - first_size
    index[0] = (n, len(piece))
    body = index.tobytes()
    forged = body + _crc(body) + piece + rest
    _replace_object(storage, key, commit, name, forged)
    assert len(bomb) < 64 << 10
    with bounded_allocation(), pytest.raises(CorruptDataError):
        read_everything(memory_url)
    assert not verify_store(routelog.open_store(memory_url)).ok


@pytest.mark.parametrize("document", ["seal", "commit", "annotation", "run"])
def test_json_nested_a_hundred_thousand_deep_is_refused(memory_url: str, document: str) -> None:
    build_store(memory_url, sealed=document == "seal")
    storage = routelog.open_store(memory_url).storage
    documents = {
        "seal": keys.seal_key(0),
        "commit": _first_commit(storage)[0],
        "annotation": keys.annotation_key(0, "trainer.00000000.json"),
        "run": keys.RUN_DOCUMENT,
    }
    storage.write(documents[document], b'{"format_version": 1, "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")
    with bounded_allocation(), pytest.raises(CorruptDataError, match="nested"):
        read_everything(memory_url)


def test_features_of_the_wrong_type_are_corruption_everywhere(memory_url: str) -> None:
    _unsealed_store_with_first_commit(memory_url, "features", 5)
    with pytest.raises(CorruptDataError, match="features"):
        read_everything(memory_url)
    assert any("features" in p for p in verify_store(routelog.open_store(memory_url)).problems)
    assert any("features" in d for d in collect_garbage(routelog.open_store(memory_url), 0, force=True).damaged)
    with pytest.raises(GcRefusedError):
        collect_garbage(routelog.open_store(memory_url), 0, delete=True, force=True)


def test_a_newer_commit_inside_a_v1_seal_is_refused(memory_url: str) -> None:
    build_store(memory_url)
    storage = routelog.open_store(memory_url).storage
    seal = json.loads(storage.read(keys.seal_key(0)))
    info = seal["consolidated"]["commits"]
    commits_key = f"{keys.step_dir(0)}/{info['key']}"
    docs = json.loads(storage.read(commits_key))
    docs[0]["format_version"] = 2
    docs[0]["features"] = ["dedup-spans-v9"]
    data = json.dumps(docs).encode()
    storage.write(commits_key, data)
    info.update(size=len(data), sha256=hashlib.sha256(data).hexdigest())
    storage.write(keys.seal_key(0), json.dumps(seal).encode())
    with pytest.raises(FormatVersionError):
        read_everything(memory_url)


# -- payload and spec bombs -------------------------------------------------------------------------------------------
def _npy_with_header(shape: tuple[int, ...], dtype: str, body: bytes) -> bytes:
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": dtype, "fortran_order": False, "shape": shape})
    return header.getvalue() + body


def _vllm_line(routed: Any, **choice: Any) -> dict[str, Any]:
    return {
        "request": {},
        "response": {
            "id": "cmpl-bomb",
            "prompt_token_ids": [1, 2, 3],
            "choices": [{"index": 0, "token_ids": [4, 5], "routed_experts": routed, **choice}],
        },
    }


def test_an_npy_header_declaring_a_trillion_elements_is_refused() -> None:
    raw = _npy_with_header((10**12, 6, 4), "|u1", b"\x00" * 96)
    response = _vllm_line(base64.b64encode(raw).decode())["response"]
    with bounded_allocation(), pytest.raises(IngestError, match=r"cmpl-bomb.*header declares"):
        vllm.records_from_http(response, SPEC)


def test_an_npz_member_declaring_2_to_the_40_bytes_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "batch.npz"
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("routed_experts.npy", _npy_with_header((2**40,), "<i2", b"\x00" * 64))
    with bounded_allocation(), pytest.raises(IngestError, match=r"header declares|holds"):
        load_arrays(path)


def test_an_sglang_prompt_of_three_hundred_million_tokens_with_four_rows_is_refused() -> None:
    routed = base64.b64encode(np.zeros((4, 6, 4), "<i4").tobytes()).decode()
    response = {
        "meta_info": {"id": "rid-bomb", "routed_experts": routed, "prompt_tokens": 3 * 10**8},
        "output_ids": [1],
    }
    with bounded_allocation(), pytest.raises(IngestError, match="rid-bomb"):
        sglang.records_from_http(response, SPEC)


def test_a_moe_layer_freq_of_four_billion_entries_is_refused() -> None:
    with bounded_allocation(), pytest.raises(ModelSpecError, match="entries"):
        ModelSpec.from_megatron(num_layers=4, num_moe_experts=8, moe_router_topk=2, moe_layer_freq="[0]*4000000000")


def _routes(rows: int, dtype: str = "|u1") -> str:
    ids = np.tile(np.arange(4, dtype=np.uint8), (rows, 6, 1))
    buffer = io.BytesIO()
    np.save(buffer, ids.astype(dtype))
    return base64.b64encode(buffer.getvalue()).decode()


MALFORMED: dict[str, tuple[str, Any]] = {
    # name: (engine, JSONL line)
    "choices not a list": ("vllm", {"response": {"id": "r1", "choices": {"0": {}}}}),
    "a choice not an object": ("vllm", {"response": {"id": "r2", "choices": ["routed"]}}),
    "prompt_start a string": ("vllm", {**_vllm_line(_routes(4)), "request": {"routed_experts_prompt_start": "abc"}}),
    "prompt_start negative": ("vllm", {**_vllm_line(_routes(4)), "request": {"routed_experts_prompt_start": -3}}),
    "token ids beyond int64": ("vllm", _vllm_line(_routes(4), token_ids=[10**20, 5])),
    "token ids as floats": ("vllm", _vllm_line(_routes(4), token_ids=[4.5, 5])),
    "token ids nested": ("vllm", _vllm_line(_routes(4), token_ids=[[4], [5]])),
    "token ids a string": ("vllm", _vllm_line(_routes(4), token_ids="4 5")),
    "routed experts a number": ("vllm", _vllm_line(7)),
    "routed experts ragged lists": ("vllm", _vllm_line([[[0, 1, 2, 3]] * 6, [[0, 1, 2]] * 6])),
    "routed experts floats": ("vllm", _vllm_line([[[0.5, 1, 2, 3]] * 6] * 4)),
    "routed experts booleans": ("vllm", _vllm_line([[[True, False, True, False]] * 6] * 4)),
    "routed experts object npy": ("vllm", _vllm_line(_routes(4, "|O"))),
    "choice index a string": ("vllm", _vllm_line(_routes(4), index="zero")),
    "meta_info a string": ("sglang", {"response": {"meta_info": "routed", "output_ids": [1]}}),
    "response a number": ("sglang", {"response": 12}),
    "output_ids of strings": ("sglang", {"response": {"meta_info": {"routed_experts": "AAAA"}, "output_ids": ["a"]}}),
    "start_len a float": (
        "sglang",
        {
            "request": {"input_ids": [1], "routed_experts_start_len": 0.5},
            "response": {"meta_info": {"routed_experts": "AAAA"}},
        },
    ),
    "sgl_ext a list": ("sglang", {"response": {"id": "c", "prompt_token_ids": [1], "choices": [{"sgl_ext": []}]}}),
    "a line that is a list of numbers": ("sglang", [1, 2, 3]),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_payloads_get_an_ingest_error_naming_the_line(tmp_path: Path, case: str) -> None:
    engine, line = MALFORMED[case]
    path = tmp_path / "payloads.jsonl"
    path.write_text(json.dumps(line) + "\n")
    with pytest.raises(IngestError) as info:
        list(read_records(engine, [path], SPEC))  # type: ignore[arg-type]
    assert f"{path}:1" in str(info.value)


def test_a_payload_nested_a_hundred_thousand_deep_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "deep.jsonl"
    path.write_text("[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(IngestError, match="nested"):
        list(read_records("vllm", [path], SPEC))
