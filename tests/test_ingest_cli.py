"""``routelog ingest``, ``convert`` and ``spec`` on files as users log them; engine -> routelog -> engine is exact."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

import routelog
from routelog.cli import app
from routelog.engines import to_full_axis

from .test_engines import DSV3, npy_b64, sglang_meta, truth, verl_batch, vllm_022_choice

runner = CliRunner()


def _run(*args: str) -> str:
    result = runner.invoke(app, list(args), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.stdout


@pytest.fixture
def spec_file(tmp_path: Path) -> Path:
    path = tmp_path / "config.json"
    path.write_text(
        json.dumps(
            {
                "model_type": "deepseek_v3",
                "num_hidden_layers": 8,
                "first_k_dense_replace": 3,
                "n_routed_experts": 64,
                "num_experts_per_tok": 6,
                "n_group": 8,
                "topk_group": 4,
            }
        )
    )
    return path


def test_spec_command(spec_file: Path) -> None:
    spec = routelog.ModelSpec.model_validate_json(_run("spec", "--hf-config", str(spec_file)))
    assert spec == DSV3.model_copy(update={"name": spec.name})


def _vllm_log(directory: Path, routes: dict[str, np.ndarray]) -> Path:
    """A JSONL log of vLLM 0.22 responses (routing per choice), one line per request id in ``routes``, with the
    request's metadata ``uid`` = ``u-<id>``."""
    lines = []
    for rid, ids in routes.items():
        choice = {"index": 0, "token_ids": list(range(ids.shape[0] - 4)), "routed_experts": vllm_022_choice(DSV3, ids)}
        response = {"id": rid, "choices": [choice]}
        lines.append({"request": {"prompt": [1, 2, 3, 4], "metadata": {"uid": f"u-{rid}"}}, "response": response})
    log = directory / "rollouts.jsonl"
    log.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    return log


def test_vllm_jsonl_ingest_and_convert_back(tmp_path: Path, spec_file: Path) -> None:
    routes = {f"cmpl-{i}": truth(DSV3, 8 + i, seed=i) for i in range(3)}
    log = _vllm_log(tmp_path, routes)
    url = str(tmp_path / "store")
    _run(
        "ingest",
        str(log),
        "--engine",
        "vllm",
        "--model-spec",
        str(spec_file),
        "--to",
        url,
        "--step",
        "3",
        "--sample-id-field",
        "request.metadata.uid",
        "--policy-version",
        "3",
        "--topk-order",
        "score",
    )
    snapshot = routelog.open_store(url).step(3)
    assert snapshot.sample_ids == [f"u-cmpl-{i}" for i in range(3)]
    assert snapshot.info("u-cmpl-1").policy_version == 3
    out = tmp_path / "vllm.npz"
    _run("convert", url, "--to", "vllm", "--step", "3", str(out))
    with np.load(out, allow_pickle=False) as exported:
        for rid, ids in routes.items():
            assert npy_b64(exported[f"u-{rid}"]) == vllm_022_choice(DSV3, ids), "engine -> routelog -> engine"
    full = tmp_path / "full.npz"
    _run("convert", url, "--to", "full", "--step", "3", str(full))
    with np.load(full, allow_pickle=False) as exported:
        first = exported["u-cmpl-0"]
        assert first.shape == (8, 8, 6)
        assert (first[:, :3] == -1).all() and (first[-1] == -1).all()


def test_ingest_writes_the_codec_asked_for_and_reads_back_alike(tmp_path: Path, spec_file: Path) -> None:
    """``--codec ranked_context``: the archive codec (a model per part); the routing reads back as the default's."""
    log = _vllm_log(tmp_path, {f"cmpl-{i}": truth(DSV3, 30 + i, seed=i) for i in range(4)})
    read = {}
    source = [str(log), "--engine", "vllm", "--model-spec", str(spec_file), "--step", "0"]
    for codec in ("ranked_gaps", "ranked_context"):
        url = str(tmp_path / codec)
        _run("ingest", *source, "--to", url, "--codec", codec)
        snapshot = routelog.open_store(url).step(0)
        assert {c.routing.transform for c in snapshot.commits} == {codec}
        read[codec] = {got.sample_id: got.expert_ids for got in snapshot.read_many(snapshot.sample_ids)}
    assert read["ranked_gaps"].keys() == read["ranked_context"].keys() and len(read["ranked_gaps"]) == 4
    for sid, ids in read["ranked_gaps"].items():
        np.testing.assert_array_equal(read["ranked_context"][sid], ids)
    result = runner.invoke(app, ["ingest", *source, "--to", str(tmp_path / "x"), "--codec", "zip"])
    assert result.exit_code != 0 and "--codec" in result.output


def test_megatron_server_responses_ingest_and_convert_back_exactly(tmp_path: Path, spec_file: Path) -> None:
    """megatron-core's completions server: ``moe_topk_indices`` ``[n - 1, num_moe_layers, K]`` int32 in each of the
    three JSON forms it reaches a log in, token ids in the choice (chat: in ``message``). Ingested, exported with
    ``convert --to megatron`` and ingested again, every record is identical."""
    routes = {f"cmpl-{i}": truth(DSV3, 9 + i, seed=20 + i) for i in range(3)}
    forms = [
        lambda rows: rows.tolist(),
        lambda rows: {"data": rows.tolist(), "dtype": "int32"},
        lambda rows: ["ndarray", {"data": rows.tolist(), "dtype": "int32"}],
    ]
    lines = []
    for (rid, ids), form in zip(routes.items(), forms, strict=True):
        prompt, generated = list(range(100, 104)), list(range(200, 200 + ids.shape[0] - 4))
        rows = ids[:-1].astype(np.int32)  # the last generated token is never forwarded
        choice = {
            "index": 0,
            "text": "...",
            "prompt_token_ids": prompt,
            "generation_token_ids": generated,
            "generation_log_probs": [-0.5] * len(generated),
            "moe_topk_indices": form(rows),
            "prompt_moe_topk_indices": form(rows[:4]),
        }
        if rid == "cmpl-2":  # chat completions: the token ids and routing under message
            choice = {"index": 0, "message": {"role": "assistant", **choice}}
        lines.append({"id": rid, "object": "text_completion", "choices": [choice]})
    log = tmp_path / "megatron.jsonl"
    log.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    url = str(tmp_path / "store")
    common = ["--engine", "megatron", "--model-spec", str(spec_file), "--topk-order", "score"]
    _run("ingest", str(log), *common, "--to", url, "--step", "0")
    snapshot = routelog.open_store(url).step(0)
    assert snapshot.sample_ids == [f"cmpl-{i}/0" for i in range(3)]
    for rid, ids in routes.items():
        got = snapshot.read(f"{rid}/0")
        np.testing.assert_array_equal(got.expert_ids[:-1], ids[:-1])
        assert not got.valid[-1] and got.info.engine == "megatron"
        assert got.info.token_ids is not None and list(got.info.token_ids[:4]) == [100, 101, 102, 103]
    exported = tmp_path / "back.jsonl"
    _run("convert", url, "--to", "megatron", "--step", "0", str(exported))
    again = str(tmp_path / "again")
    _run("ingest", str(exported), *common, "--to", again, "--step", "0", "--sample-id-field", "sample_id")
    second = routelog.open_store(again).step(0)
    assert second.sample_ids == snapshot.sample_ids
    for sid in snapshot.sample_ids:
        first, back = snapshot.read(sid), second.read(sid)
        np.testing.assert_array_equal(back.expert_ids, first.expert_ids)
        np.testing.assert_array_equal(back.valid, first.valid)
        assert back.info.token_hash == first.info.token_hash
        assert (back.info.prompt_len, back.info.response_len) == (first.info.prompt_len, first.info.response_len)


def test_sglang_jsonl_ingest(tmp_path: Path, spec_file: Path) -> None:
    ids = truth(DSV3, 10, seed=5)
    line = {
        "request": {"input_ids": [1, 2, 3, 4], "return_routed_experts": True},
        "response": {
            "output_ids": [5, 6, 7, 8, 9, 10],
            "meta_info": {"id": "rid-7", "routed_experts": sglang_meta(DSV3, ids)},
        },
    }
    log = tmp_path / "sglang.jsonl"
    log.write_text(json.dumps(line) + "\n")
    url = str(tmp_path / "store")
    _run("ingest", str(log), "--engine", "sglang", "--model-spec", str(spec_file), "--to", url, "--step", "0")
    got = routelog.open_store(url).step(0).read("rid-7")
    np.testing.assert_array_equal(got.expert_ids[:-1], np.sort(ids[:-1], axis=-1))
    assert got.info.token_hash == routelog.token_hash(list(range(1, 11)))


def test_verl_npz_and_slime_safetensors(tmp_path: Path, spec_file: Path) -> None:
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    seqs = [(truth(DSV3, 9, seed=11), 3), (truth(DSV3, 12, seed=12), 5)]
    batch = verl_batch(DSV3, seqs, prompt_max=5, response_max=8, axis="full")
    np.savez(tmp_path / "batch.npz", **batch)
    url = str(tmp_path / "store")
    _run(
        "ingest",
        str(tmp_path / "batch.npz"),
        "--engine",
        "verl",
        "--model-spec",
        str(spec_file),
        "--to",
        url,
        "--step",
        "1",
        "--topk-order",
        "score",
    )
    out = tmp_path / "verl.npz"
    _run("convert", url, "--to", "verl", "--step", "1", str(out), "--prompt-length", "5", "--response-length", "8")
    with np.load(out, allow_pickle=False) as exported:
        for key in ("routed_experts", "attention_mask", "input_ids"):
            np.testing.assert_array_equal(exported[key], batch[key])
        assert exported["sample_ids"].tolist() == ["batch/0", "batch/1"]

    ids = truth(DSV3, 7, seed=13)
    samples = {
        "s-1/rollout_routed_experts": to_full_axis(ids[:-1], DSV3).astype(np.int32),
        "s-1/tokens": np.arange(7),
        "s-1/response_length": np.asarray(4),
    }
    safetensors_numpy.save_file(samples, str(tmp_path / "slime.safetensors"))
    _run(
        "ingest",
        str(tmp_path / "slime.safetensors"),
        "--engine",
        "slime",
        "--to",
        url,
        "--step",
        "2",
        "--topk-order",
        "score",
    )
    out = tmp_path / "slime.npz"
    _run("convert", url, "--to", "slime", "--step", "2", str(out))
    with np.load(out, allow_pickle=False) as exported:
        for key, value in samples.items():
            np.testing.assert_array_equal(exported[key], value)


def test_ingest_errors_name_file_line_and_request(tmp_path: Path, spec_file: Path) -> None:
    ids = truth(DSV3, 6, seed=14)
    bad = {
        "id": "cmpl-x",
        "prompt_token_ids": [1, 2],
        "choices": [{"token_ids": [3, 4, 5, 6], "routed_experts": vllm_022_choice(DSV3, ids)[:-8]}],
    }
    log = tmp_path / "bad.jsonl"
    log.write_text("\n" + json.dumps(bad) + "\n")
    result = runner.invoke(
        app,
        [
            "ingest",
            str(log),
            "--engine",
            "vllm",
            "--model-spec",
            str(spec_file),
            "--to",
            str(tmp_path / "s"),
            "--step",
            "0",
        ],
    )
    assert isinstance(result.exception, routelog.IngestError)
    assert f"{log}:2" in str(result.exception) and "cmpl-x" in str(result.exception)


def test_megatron_server_payload_errors_name_the_choice_and_the_fix() -> None:
    from routelog.engines import megatron_server
    from routelog.errors import IngestError, RoutingAbsentError

    ids = truth(DSV3, 9, seed=3)
    choice = {"index": 1, "prompt_token_ids": [1, 2, 3], "generation_token_ids": list(range(6))}
    with pytest.raises(RoutingAbsentError, match=r"choice 1: no moe_topk_indices.*moe_enable_routing_replay"):
        megatron_server.records_from_http({"id": "r", "choices": [choice]}, DSV3)
    short = {**choice, "moe_topk_indices": ids[:-2].tolist()}
    with pytest.raises(IngestError, match=r"request r choice 1: 7 routing rows, expected 8"):
        megatron_server.records_from_http({"id": "r", "choices": [short]}, DSV3)
    floats = {**choice, "moe_topk_indices": {"data": ids[:-1].tolist(), "dtype": "float32"}}
    with pytest.raises(IngestError, match=r"moe_topk_indices.dtype is 'float32'"):
        megatron_server.records_from_http({"id": "r", "choices": [floats]}, DSV3)
    no_prompt = {**choice, "prompt_token_ids": None, "moe_topk_indices": ids[:-1].tolist()}
    with pytest.raises(IngestError, match="return_prompt_tokens"):
        megatron_server.records_from_http({"id": "r", "choices": [no_prompt]}, DSV3)
    record = megatron_server.records_from_http(
        {"id": "r", "choices": [{**choice, "moe_topk_indices": ids[:-1].tolist()}]}, DSV3
    )[0]
    record.valid[2] = False
    with pytest.raises(IngestError, match=r"row 2 has no route"):
        megatron_server.encode(record, DSV3)


WIRE_FORMS = ("vllm", "vllm-0.21", "sglang", "nemo-rl", "ms-swift", "megatron")


def _engine_records(order: str, *, late_start: bool = True) -> list[routelog.Record]:
    """What an engine would have given: full routing (the final token unrouted), a record whose rows start late in
    its prompt (a continuation's ``prompt_start``; megatron's server has none), and one response token."""
    rng = np.random.default_rng(11)
    moe, experts, k = len(DSV3.moe_layers), DSV3.num_experts, DSV3.topk
    out = []
    for i, (prompt, response, start) in enumerate([(5, 7, 0), (9, 4, 6 if late_start else 0), (6, 1, 0), (4, 8, 0)]):
        n = prompt + response
        ids = np.argsort(rng.random((n, moe, experts)), axis=-1)[..., :k]
        ids = ids if order == "score" else np.sort(ids, axis=-1)
        valid = np.ones(n, bool)
        valid[-1] = False  # never forwarded
        valid[:start] = False
        out.append(
            routelog.Record(
                sample_id=f"s-{i}",
                expert_ids=ids,
                prompt_len=prompt,
                response_len=response,
                valid=valid,
                token_ids=rng.integers(1, 30_000, n),
                payload_start=start or None,
            )
        )
    return out


@pytest.mark.parametrize("order", ["sorted", "score"])
@pytest.mark.parametrize("form", WIRE_FORMS)
def test_every_engine_form_round_trips_exactly(tmp_path: Path, spec_file: Path, form: str, order: str) -> None:
    """routelog -> engine -> routelog -> engine: ``convert --to <engine>`` writes each record as the response the
    engine's client receives (the request beside it); ``ingest --engine <engine>`` reads it back to the same
    routing, rows, token ids, lengths and sample ids, and converting that again writes the same bytes."""
    url = str(tmp_path / "first")
    options = routelog.PartOptions(topk_order=order)
    with routelog.open_writer(url, step=0, model_spec=DSV3, options=options) as writer:
        for record in _engine_records(order, late_start=form != "megatron"):
            writer.append(record)
    exported = tmp_path / f"{form}.jsonl"
    _run("convert", url, "--to", form, "--step", "0", str(exported))
    lines = [json.loads(line) for line in exported.read_text().splitlines()]
    assert [line["sample_id"] for line in lines] == [f"s-{i}" for i in range(4)]
    if form != "megatron":
        assert all(set(line) == {"sample_id", "request", "response"} for line in lines), "the engine's own response"
    again = str(tmp_path / "again")
    engine = "vllm" if form == "vllm-0.21" else form
    _run("ingest", str(exported), "--engine", engine, "--model-spec", str(spec_file), "--to", again, "--step", "0",
         "--topk-order", order, "--sample-id-field", "sample_id")  # fmt: skip
    first, second = routelog.open_store(url).step(0), routelog.open_store(again).step(0)
    assert second.sample_ids == first.sample_ids
    for sid in second.sample_ids:
        a, b = first.read(sid), second.read(sid)
        assert (b.info.prompt_len, b.info.response_len) == (a.info.prompt_len, a.info.response_len), sid
        assert b.info.token_hash == a.info.token_hash, sid
        np.testing.assert_array_equal(b.valid, a.valid, err_msg=sid)
        np.testing.assert_array_equal(b.expert_ids[a.valid], a.expert_ids[a.valid], err_msg=sid)
    back = tmp_path / f"{form}-again.jsonl"
    _run("convert", again, "--to", form, "--step", "0", str(back))
    assert back.read_text() == exported.read_text(), "engine -> routelog -> engine, byte for byte"


@pytest.mark.parametrize("ids_as", ["unicode", "bytes"])
def test_verl_batches_round_trip_with_their_sample_ids(tmp_path: Path, spec_file: Path, ids_as: str) -> None:
    """``convert --to verl`` writes the batch with a ``sample_ids`` string member; ``ingest --engine verl`` reads it
    (fixed-width unicode or bytes: no pickle) to the same records, while an object array is still refused."""
    url = str(tmp_path / "first")
    with routelog.open_writer(url, step=0, model_spec=DSV3) as writer:
        for record in _engine_records("sorted", late_start=False):
            writer.append(record)
    batch = tmp_path / "verl.npz"
    _run("convert", url, "--to", "verl", "--step", "0", str(batch))
    with np.load(batch, allow_pickle=False) as arrays:
        members = {k: arrays[k] for k in arrays.files}
    assert members["sample_ids"].dtype.kind == "U"
    if ids_as == "bytes":
        members["sample_ids"] = members["sample_ids"].astype("S")
    np.savez(batch, **members)
    again = str(tmp_path / "again")
    _run("ingest", str(batch), "--engine", "verl", "--model-spec", str(spec_file), "--to", again, "--step", "0")
    first, second = routelog.open_store(url).step(0), routelog.open_store(again).step(0)
    assert second.sample_ids == first.sample_ids
    for sid in first.sample_ids:
        a, b = first.read(sid), second.read(sid)
        np.testing.assert_array_equal(b.valid, a.valid)
        np.testing.assert_array_equal(b.expert_ids[a.valid], a.expert_ids[a.valid])
    np.savez(batch, **{**members, "sample_ids": np.asarray(list(first.sample_ids), dtype=object)})
    result = runner.invoke(
        app, ["ingest", str(batch), "--engine", "verl", "--model-spec", str(spec_file), "--to", again, "--step", "1"]
    )
    assert result.exit_code != 0 and "object arrays need pickle, which routelog refuses" in str(result.exception)


def test_stream_chunks_and_aborts_say_what_they_are(tmp_path: Path) -> None:
    """A streamed generate file without --stream-request, or its lone final chunk, is named a stream chunk with the
    option that reads it; an aborted SGLang request points to --skip-absent."""
    engines = Path(__file__).parent / "fixtures" / "engines"
    stream = engines / "vllm-0.33.0-generate-stream"
    spec = str(stream / "model_spec.json")
    last = tmp_path / "last.jsonl"
    last.write_text((stream / "stream.jsonl").read_text().splitlines()[-1] + "\n")
    for source in (stream / "stream.jsonl", last):
        result = runner.invoke(
            app, ["ingest", str(source), "--engine", "vllm", "--model-spec", spec, "--to", str(tmp_path / "s"),
                  "--step", "0"],
        )  # fmt: skip
        assert result.exit_code != 0
        message = str(result.exception)
        assert "chunk of a streamed response" in message and "--stream-request" in message, message
        assert "--enable-return-routed-experts" not in message
    _run("ingest", str(stream / "stream.jsonl"), "--engine", "vllm", "--model-spec", spec, "--to",
         str(tmp_path / "s"), "--step", "0", "--stream-request", str(stream / "request.json"))  # fmt: skip
    abort = engines / "sglang-0.5.23-generate-abort"
    log = tmp_path / "abort.jsonl"  # the second response was aborted before it was scheduled: no routing
    log.write_text("".join(json.dumps(r) + "\n" for r in json.loads((abort / "responses.json").read_text())))
    result = runner.invoke(
        app, ["ingest", str(log), "--engine", "sglang", "--model-spec", str(abort / "model_spec.json"), "--to",
              str(tmp_path / "a"), "--step", "0"],
    )  # fmt: skip
    assert result.exit_code != 0 and "--skip-absent" in str(result.exception), result.exception
