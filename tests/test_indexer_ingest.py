"""SGLang's DSA indexer top-k (``meta_info.indexer_topk``) into ``Record.indexer`` and back: the fixtures built by
``tools/make_engine_fixtures.py`` from SGLang 0.5.23's own capture code ingest exactly, ``convert --to sglang`` writes
SGLang's layout back and re-ingests to the same rows, and every payload that is not what SGLang sends is refused
naming what is wrong."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

import routelog
from routelog import ModelSpec, Record
from routelog.cli import app
from routelog.engines import sglang
from routelog.errors import IngestError

FIXTURES = Path(__file__).parent / "fixtures" / "engines"
GLM = "sglang-0.5.23-generate-indexer-glm-dsa"
V32 = "sglang-0.5.23-generate-indexer-v32"


def _json(fixture: str, name: str) -> Any:
    return json.loads((FIXTURES / fixture / name).read_text())


def _hf_config(fixture: str) -> dict[str, Any]:
    config: dict[str, Any] = _json(fixture, "SOURCE.json")["model_hf_config"]
    return config


def _spec(fixture: str) -> ModelSpec:
    """The spec ``from_hf_config`` derives from the HF config the fixture mimics (its indexer layers included)."""
    spec = ModelSpec.from_hf_config(_hf_config(fixture))
    assert spec.indexer is not None
    assert spec.indexer.model_dump(mode="json") == _json(fixture, "model_spec.json")["indexer"]
    return spec


def _exchanges(fixture: str) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(request, response) per /generate response of the fixture (a batched request split per prompt)."""
    responses = _json(fixture, "responses.json")
    if (FIXTURES / fixture / "requests.json").exists():
        return list(zip(_json(fixture, "requests.json"), responses, strict=True))
    batched = _json(fixture, "request.json")
    return [({**batched, "input_ids": ids}, r) for ids, r in zip(batched["input_ids"], responses, strict=True)]


def _expected_indexer(fixture: str) -> list[np.ndarray]:
    with np.load(FIXTURES / fixture / "expected.npz", allow_pickle=False) as data:
        return [data[f"{i}_indexer"] for i in range(len(data["sample_ids"]))]


def _ingest(request: dict[str, Any], response: dict[str, Any], spec: ModelSpec) -> Record:
    return sglang.record_from_generate(response, spec, request=request, engine_version="0.5.23")


def _raw(response: dict[str, Any], spec: ModelSpec) -> np.ndarray:
    """The payload's indexer_topk as SGLang's array ``[n - 1, num_hidden_layers, index_topk]``."""
    assert spec.indexer is not None
    flat = np.frombuffer(base64.b64decode(response["meta_info"]["indexer_topk"]), "<i4")
    return flat.reshape(-1, spec.num_layers, spec.indexer.index_topk).copy()


def _with_raw(response: dict[str, Any], raw: np.ndarray) -> dict[str, Any]:
    meta = {**response["meta_info"], "indexer_topk": sglang.encode_int32_base64(raw)}
    return {**response, "meta_info": meta}


@pytest.mark.parametrize("fixture", [GLM, V32])
def test_sglang_indexer_topk_ingests_exactly(fixture: str) -> None:
    spec = _spec(fixture)
    for (request, response), want in zip(_exchanges(fixture), _expected_indexer(fixture), strict=True):
        raw = _raw(response, spec)
        assert (np.diff(np.where(raw < 0, 1 << 20, raw), axis=-1) < 0).any(), "the fixture's rows are unordered"
        record = _ingest(request, response, spec)
        assert record.indexer is not None
        np.testing.assert_array_equal(record.indexer, want, err_msg=record.sample_id)
        assert (np.asarray(record.indexer)[-1] == -1).all()  # the last sampled token is never forwarded
        plain = _ingest(request, {**response, "meta_info": {**response["meta_info"], "indexer_topk": None}}, spec)
        assert plain.indexer is None  # without indexer_topk the routing alone, as before
        np.testing.assert_array_equal(np.asarray(plain.expert_ids), np.asarray(record.expert_ids))


def test_indexer_rows_ignore_routed_experts_start_len() -> None:
    """SGLang 0.5.23 reads indexer rows [0, n - 1) whatever routed_experts_start_len says (routing from it)."""
    spec = _spec(V32)
    request, response = _exchanges(V32)[1]
    record = _ingest(request, response, spec)
    start = request["routed_experts_start_len"]
    assert record.payload_start == start and not np.asarray(record.valid)[:start].any()
    indexer = np.asarray(record.indexer)
    assert (indexer[:start] >= 0).any(axis=-1).all()  # every row before the start holds positions
    np.testing.assert_array_equal(indexer, _expected_indexer(V32)[1])


def test_engine_order_padding_and_never_written_rows_are_canonicalized() -> None:
    """A kernel may put -1 anywhere in a row and in any order (flashinfer top-k, sorted=False); a row SGLang's
    zeroed host buffer never received is all zeros: rows are sorted, -1 last, and a zero row is a token not run."""
    spec = _spec(GLM)
    request, response = _exchanges(GLM)[0]
    raw = _raw(response, spec)
    shuffled = np.random.default_rng(0).permuted(raw, axis=-1)  # -1 pads land anywhere
    shuffled[:, [2, 4]] = shuffled[:, [1, 3]]  # shared layers hold the very copy of their source
    shuffled[9] = 0
    record = _ingest(request, _with_raw(response, shuffled), spec)
    want = _expected_indexer(GLM)[0].copy()
    want[9] = -1
    np.testing.assert_array_equal(record.indexer, want)


def _refused(fixture: str, raw: np.ndarray | None = None, spec: ModelSpec | None = None, i: int = 0) -> str:
    request, response = _exchanges(fixture)[i]
    spec = spec or _spec(fixture)
    with pytest.raises(IngestError) as caught:
        _ingest(request, response if raw is None else _with_raw(response, raw), spec)
    return str(caught.value)


def test_a_wrong_byte_count_is_refused_before_decoding() -> None:
    spec = _spec(GLM)
    raw = _raw(_exchanges(GLM)[0][1], spec)
    message = _refused(GLM, raw[:-1])
    assert "request sgl-dsa-0 (sample 'sgl-dsa-0'): indexer_topk holds 1248 bytes, expected 1344" in message
    assert "14 rows" in message and "6 decoder layers" in message and "index_topk 4" in message
    request, response = _exchanges(GLM)[0]
    for text, held in (("AAAA=", "no whole number of bytes"), ("!!!!", "holds 3 bytes")):  # "!!!!" is never decoded
        broken = {**response, "meta_info": {**response["meta_info"], "indexer_topk": text}}
        with pytest.raises(IngestError, match=held):
            _ingest(request, broken, spec)


def test_a_shared_layer_differing_from_its_source_is_refused() -> None:
    spec = _spec(GLM)
    raw = _raw(_exchanges(GLM)[0][1], spec)
    raw[7, 4] = raw[7, 5]  # layer 4 reuses layer 3's selection; at token 7 it holds another
    message = _refused(GLM, raw)
    assert "sample 'sgl-dsa-0'" in message
    assert "layer 4, which the model spec declares as reusing layer 3's selection, differs from it at token 7" in (
        message
    )


def test_kv_slot_values_are_refused_naming_the_token_and_the_fix() -> None:
    spec = _spec(V32)
    raw = _raw(_exchanges(V32)[0][1], spec)
    raw[5:, 2] = np.where(raw[5:, 2] >= 0, raw[5:, 2] + 40, -1)  # KV-pool slots of a request placed at slot 40
    message = _refused(V32, raw)
    assert "sample 'sgl-dsa-0'" in message and "indexer_topk of layer 2" in message
    assert "row 5 (the query at position 5)" in message and "past the query's own position 5" in message
    assert "look like KV-cache slots" in message and "SGLANG_DSA_FUSE_TOPK=0" in message


def test_a_spec_without_an_indexer_is_refused_naming_the_fix() -> None:
    config = {**_hf_config(V32), "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"]}
    spec = ModelSpec.from_hf_config(config)
    assert spec.indexer is None
    message = _refused(V32, spec=spec)
    assert "carries indexer_topk" in message and "declare ModelSpec.indexer" in message


def test_chat_meta_info_indexer_topk_is_read_too() -> None:
    """A chat choice's meta_info is /generate's (return_meta_info); 0.5.23's chat cannot ask for indexer rows, but
    a server that adds them there is read the same way."""
    spec = _spec(GLM)
    request, response = _exchanges(GLM)[0]
    prompt = request["input_ids"]
    choice = {"index": 0, "prompt_token_ids": prompt, "response_token_ids": response["output_ids"]}
    chat = {"id": "chat-1", "choices": [{**choice, "meta_info": response["meta_info"]}]}
    (record,) = sglang.records_from_http(chat, spec, engine_version="0.5.23")
    np.testing.assert_array_equal(record.indexer, _expected_indexer(GLM)[0])


def _cli(*args: str) -> None:
    result = CliRunner().invoke(app, list(args), catch_exceptions=False)
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("fixture", [GLM, V32])
def test_convert_to_sglang_writes_the_indexer_back_and_round_trips(tmp_path: Path, fixture: str) -> None:
    spec = _spec(fixture)
    config = tmp_path / "config.json"
    config.write_text(json.dumps(_hf_config(fixture)))
    log = tmp_path / "responses.jsonl"
    log.write_text("".join(json.dumps({"request": q, "response": r}) + "\n" for q, r in _exchanges(fixture)))
    first, second = f"file://{tmp_path}/first", f"file://{tmp_path}/second"
    _cli("ingest", str(log), "--engine", "sglang", "--model-spec", str(config), "--to", first, "--step", "0")
    out = tmp_path / "out.jsonl"
    _cli("convert", first, "--to", "sglang", "--step", "0", str(out))
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    wants = dict(zip([r["meta_info"]["id"] for _, r in _exchanges(fixture)], _expected_indexer(fixture), strict=True))
    assert spec.indexer is not None
    for line in lines:
        want, response = wants[line["sample_id"]], line["response"]
        assert line["request"]["return_indexer_topk"] is True
        raw = _raw(response, spec)  # SGLang's layout: rows [0, n - 1), every decoder layer, shared ones a copy
        assert raw.shape[0] == want.shape[0] - 1
        np.testing.assert_array_equal(raw[:, list(spec.indexer.layers)], want[:-1])
        for layer in spec.indexer.shared:
            np.testing.assert_array_equal(raw[:, layer], raw[:, spec.indexer.layers[spec.indexer.source_of(layer)]])
    args = ("--engine", "sglang", "--model-spec", str(config), "--sample-id-field", "sample_id", "--to", second)
    _cli("ingest", str(out), *args, "--step", "0")
    again = tmp_path / "again.jsonl"
    _cli("convert", second, "--to", "sglang", "--step", "0", str(again))
    assert again.read_bytes() == out.read_bytes()
    snapshot = routelog.open_store(second).step(0)
    for sid, want in wants.items():
        np.testing.assert_array_equal(snapshot.read_indexer(sid), want)


def test_records_without_indexer_rows_export_no_field(tmp_path: Path) -> None:
    spec = _spec(GLM)
    request, response = _exchanges(GLM)[0]
    with_rows = _ingest(request, response, spec)
    without = _ingest(request, {**response, "meta_info": {**response["meta_info"], "id": "plain"}}, spec)
    without.indexer = None
    url = f"file://{tmp_path}/store"
    with routelog.create_store(url, spec).writer(0, "w") as writer:
        writer.append(with_rows)
        writer.append(without)
    out = tmp_path / "out.jsonl"
    _cli("convert", url, "--to", "sglang", "--step", "0", str(out))
    metas = {line["sample_id"]: line["response"]["meta_info"] for line in map(json.loads, out.read_text().splitlines())}
    assert "indexer_topk" in metas["sgl-dsa-0"] and "indexer_topk" not in metas["plain"]
    assert sglang.to_indexer_meta_info(without, spec) is None
