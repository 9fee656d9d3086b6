"""Files in, records out (``routelog ingest``) and records in, engine layouts out (``routelog convert``).

Inputs are what users log: JSONL of engine HTTP responses (each line the response alone, or
``{"request": ..., "response": ...}``) for vLLM and SGLang, and ``.npz`` / safetensors tensors for the trainer-side
layouts (veRL, slime). Nothing is ever unpickled.
"""

from __future__ import annotations

import hashlib
import json
import zipfile
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from routelog import interrupts
from routelog.engines import megatron_server, ms_swift, nemo_rl, sglang, slime, verl, vllm
from routelog.engines.common import list_field, load_npy, malformed, npy_header_nbytes, to_full_axis
from routelog.errors import (
    IngestError,
    InvalidRecordError,
    RoutingAbsentError,
    ValuesNotFoundError,
    WriteInterruptedError,
)
from routelog.format import keys
from routelog.format.codec import TopkOrder
from routelog.format.documents import load_json
from routelog.format.part import PartOptions
from routelog.format.record import Record, prepare_record
from routelog.format.spec import ModelSpec
from routelog.outputs import written_whole
from routelog.store.reader import StepSnapshot
from routelog.store.writer import batch_encode_threads

Engine = Literal["vllm", "sglang", "verl", "slime", "nemo-rl", "ms-swift", "megatron"]
HTTP_ENGINES = ("vllm", "sglang", "nemo-rl", "ms-swift", "megatron")
"""Engines whose routing arrives in HTTP responses (NeMo-RL's and ms-swift's envelopes wrap vLLM responses;
``megatron`` is megatron-core's own inference server)."""
MAX_LINE_BYTES = 1 << 30
"""One JSONL line (a response with base64 routing of a long sequence is tens of MB)."""
ExportLayout = Literal["verl", "slime", "full", "moe", "vllm", "vllm-0.21", "sglang", "nemo-rl", "ms-swift", "megatron"]


def _field(obj: Any, path: str) -> Any:
    """``a.b.0.c`` in nested dicts and lists; ``None`` when absent."""
    for part in path.split("."):
        if isinstance(obj, Mapping):
            obj = obj.get(part)
        elif isinstance(obj, list) and part.isdigit() and int(part) < len(obj):
            obj = obj[int(part)]
        else:
            return None
    return obj


def _http_records(
    engine: Engine,
    line: Any,
    spec: ModelSpec,
    where: str,
    sample_id_field: str | None,
    common: dict[str, Any],
    on_absent: Callable[[RoutingAbsentError], None] | None,
) -> list[Record]:
    """One JSONL line: a response, ``{"request": ..., "response": ...}``, or a logged stream
    ``{"request": ..., "chunks": [...]}`` (vLLM's streamed generate)."""
    chunks = None
    if isinstance(line, Mapping) and "chunks" in line:
        request, response, chunks = line.get("request") or {}, None, line["chunks"]
    elif isinstance(line, Mapping) and "response" in line and ("request" in line or len(line) <= 2):
        request, response = line.get("request") or {}, line["response"]
    else:
        request, response = {}, line
    sample_ids = None
    if sample_id_field:
        value = _field(line, sample_id_field)
        if value is None:
            raise IngestError(f"{where}: no field {sample_id_field!r} for the sample id")
        n = (
            len(response["choices"])
            if isinstance(response, Mapping) and isinstance(response.get("choices"), list)
            else (len(response) if isinstance(response, list) else 1)
        )
        sample_ids = [str(value)] if n == 1 else [f"{value}/{i}" for i in range(n)]
    try:
        with malformed(where):
            if chunks is not None:
                if engine != "vllm":
                    raise IngestError("streamed chunks are read for vLLM's generate endpoint only")
                return vllm.records_from_stream(
                    list_field(chunks, where, "chunks"),
                    spec,
                    request=request,
                    sample_ids=sample_ids,
                    on_absent=on_absent,
                    **common,
                )
            module = {"sglang": sglang, "megatron": megatron_server}.get(engine, vllm)
            records: list[Record] = module.records_from_http(
                response, spec, request=request, sample_ids=sample_ids, on_absent=on_absent, **common
            )
        return records
    except RoutingAbsentError as exc:
        raise RoutingAbsentError(f"{where}: {exc}", exc.reason) from exc
    except IngestError as exc:
        raise IngestError(f"{where}: {exc}") from exc


_DEFLATE_MAX_RATIO = 1100
"""Deflate expands at most ~1032:1: a member claiming more than this multiple of its stored bytes is a bomb."""


def read_table(path: Path) -> npt.NDArray[Any]:
    """A physical-to-logical expert table from ``.npy`` or JSON (``[num_physical]`` or ``[layers, num_physical]``)."""
    try:
        if path.suffix == ".npy":
            return load_npy(path.read_bytes(), str(path), "the table")
        return np.asarray(load_json(path.read_text(), str(path)))
    except OSError as exc:
        raise IngestError(f"{path}: cannot read the expert table ({exc})") from exc
    except ValueError as exc:
        raise IngestError(f"{path}: not an expert table (.npy, or a JSON list of integers): {exc}") from exc


def load_arrays(path: Path) -> dict[str, npt.NDArray[Any]]:
    """Arrays of a ``.npz`` (loaded without pickle) or ``.safetensors`` file.

    ``.npz`` members are read with their ``.npy`` headers checked against the bytes actually stored before
    anything is allocated, so a header (or a zip directory) that claims 2**40 elements is refused.
    """
    if path.suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.numpy import load_file

        try:
            return dict(load_file(str(path)))
        except (SafetensorError, ValueError, OSError) as exc:
            raise IngestError(f"{path}: not a readable safetensors file ({exc})") from None
    try:
        with zipfile.ZipFile(path) as archive:
            return {
                info.filename.removesuffix(".npy"): _read_member(archive, info, f"{path}:{info.filename}")
                for info in archive.infolist()
                if not info.is_dir()
            }
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as exc:
        if isinstance(exc, IngestError):
            raise
        raise IngestError(f"{path}: not a readable .npz file ({exc})") from None


TEXT_MEMBERS = frozenset({"sample_ids"})
"""``.npz`` members read as text (ids: fixed-width unicode or bytes); every other member is numbers."""


def _read_member(archive: zipfile.ZipFile, info: zipfile.ZipInfo, where: str) -> npt.NDArray[Any]:
    if info.file_size > _DEFLATE_MAX_RATIO * max(info.compress_size, 1) + (1 << 20):
        raise IngestError(f"{where}: claims {info.file_size} bytes from {info.compress_size} stored (a zip bomb)")
    with archive.open(info) as member:
        head = member.read(4096)
        header_len, data_len = npy_header_nbytes(head, where)
        if header_len + data_len != info.file_size:
            raise IngestError(
                f"{where}: the .npy header declares {data_len} bytes of data, the member holds "
                f"{info.file_size - header_len} (truncated or forged)"
            )
        raw = head + member.read(info.file_size - len(head) + 1)
    return load_npy(raw, where, "the member", text=info.filename.removesuffix(".npy") in TEXT_MEMBERS)


@dataclass(frozen=True, eq=False)
class IngestSource:
    """Files as an engine or trainer logged them, and how to read them."""

    engine: Engine
    paths: tuple[Path, ...]
    sample_id_field: str | None = None
    policy_version: int | None = None
    engine_version: str | None = None
    physical_to_logical: npt.ArrayLike | None = None
    eplb: bool = False
    stream_request: Mapping[str, Any] | None = None
    """Each file is the chunks of one streamed vLLM generate response for this request."""

    def records(
        self,
        spec: ModelSpec,
        *,
        on_absent: Callable[[RoutingAbsentError], None] | None = None,
        on_error: Callable[[IngestError], None] | None = None,
    ) -> Iterator[Record]:
        """Records from the files, one after another. Samples without routing raise
        :class:`~routelog.errors.RoutingAbsentError` or go to ``on_absent``; a line (or file) that cannot be read
        raises, or goes to ``on_error`` and is skipped."""
        common: dict[str, Any] = {
            "policy_version": self.policy_version,
            "engine_version": self.engine_version,
            "physical_to_logical": self.physical_to_logical,
            "eplb": self.eplb,
        }
        self.check_inputs()
        for path in self.paths:
            if self.engine in HTTP_ENGINES:
                if self.stream_request is not None:
                    units: list[tuple[str, Any]] = [
                        (str(path), {"request": self.stream_request, "chunks": [line for _, line in _json_lines(path)]})
                    ]
                else:
                    units = list(_json_lines(path, on_error))
                if not units:
                    empty = IngestError(
                        f"{path}: holds no records (an empty file, or blank lines only): check the path, or that the "
                        "engine's log was written"
                    )
                    if on_error is None:
                        raise empty
                    on_error(empty)
                for where, line in units:
                    try:
                        yield from _http_records(
                            self.engine, line, spec, where, self.sample_id_field, common, on_absent
                        )
                    except RoutingAbsentError:
                        raise
                    except IngestError as exc:
                        if on_error is None:
                            raise
                        on_error(exc)
            else:
                try:
                    arrays = load_arrays(path)
                    module = verl if self.engine == "verl" else slime
                    with malformed(str(path)):
                        records = module.records_from_arrays(
                            arrays, spec, path.stem, policy_version=self.policy_version
                        )
                except IngestError as exc:
                    if on_error is None:
                        raise
                    on_error(exc)
                    continue
                yield from records

    def check_inputs(self) -> None:
        """Every input file exists (checked before anything else is done)."""
        for path in self.paths:
            if not path.is_file():
                raise IngestError(f"{path}: no such input file")

    def fingerprint(self, *options: object) -> str:
        """A digest of the inputs' contents and of the options: the default writer id of an ingest, so that
        running the same ingest again resumes its commit sequence."""
        digest = hashlib.blake2b(digest_size=8)
        for part in (self.engine, self.sample_id_field, self.policy_version, self.engine_version, self.eplb, *options):
            digest.update(repr(part).encode())
        if self.physical_to_logical is not None:
            digest.update(np.ascontiguousarray(np.asarray(self.physical_to_logical)).tobytes())
        digest.update(json.dumps(self.stream_request, sort_keys=True).encode())
        for path in self.paths:
            digest.update(path.name.encode())
            with path.open("rb") as data:
                for block in iter(lambda: data.read(1 << 20), b""):
                    digest.update(block)
        return digest.hexdigest()


def read_records(
    engine: Engine,
    paths: Sequence[Path],
    spec: ModelSpec,
    *,
    sample_id_field: str | None = None,
    policy_version: int | None = None,
    physical_to_logical: npt.ArrayLike | None = None,
    engine_version: str | None = None,
    eplb: bool = False,
    stream_request: Mapping[str, Any] | None = None,
    on_absent: Callable[[RoutingAbsentError], None] | None = None,
) -> Iterator[Record]:
    """Records from the engine's logged files (:meth:`IngestSource.records`).

    JSONL files hold one response per line (or ``{"request": ..., "response": ...}``, or a logged stream
    ``{"request": ..., "chunks": [...]}``). With ``stream_request`` each file is instead the chunks of one streamed
    vLLM generate response, one per line, for that request.
    """
    source = IngestSource(
        engine, tuple(paths), sample_id_field, policy_version, engine_version, physical_to_logical, eplb, stream_request
    )
    return source.records(spec, on_absent=on_absent)


@dataclass
class IngestReport:
    """What an ingest did (``routelog ingest --json`` prints it)."""

    url: str
    step: int
    writer_id: str
    new: int = 0
    """Records written."""
    already_present: int = 0
    """Records skipped because the step already holds them (a re-run)."""
    absent: dict[str, int] = field(default_factory=dict)
    """Samples the engine returned no routing for, by reason (with ``skip_absent``)."""
    invalid: list[str] = field(default_factory=list)
    """Records or lines refused, with the reason (written around only with ``partial``)."""
    parts: int = 0


def ingest(
    source: IngestSource,
    url: str,
    step: int,
    *,
    spec: ModelSpec | None = None,
    storage_options: Mapping[str, Any] | None = None,
    topk_order: TopkOrder = "sorted",
    codec: Literal["ranked_gaps", "ranked_context"] = "ranked_gaps",
    writer_id: str | None = None,
    partial: bool = False,
    skip_absent: bool = False,
    on_duplicate: Literal["skip", "error"] = "skip",
    flush_bytes: int | None = None,
    progress: Callable[[int], None] | None = None,
    encode_threads: int | None = None,
) -> IngestReport:
    """Validate every record of ``source``, then write them to ``step`` of the store at ``url``.

    Nothing is written (and no store is created) unless every record is valid, or ``partial`` writes the valid
    ones and reports the rest. Records the step already holds are skipped, so running the same ingest again (after
    fixing a bad line, or after Ctrl-C) completes it; the default writer id is derived from the inputs and options,
    so a re-run also continues its commit sequence. ``codec``: the sorted sets' chunk codec
    (:attr:`~routelog.format.part.PartOptions.transform`; ``ranked_context`` for a smaller archive).
    ``encode_threads``: threads compressing each part (default: the CPUs this process may run on).
    """
    from routelog.errors import StoreNotFoundError
    from routelog.store.store import create_store, open_store

    source.check_inputs()
    threads = batch_encode_threads(encode_threads)
    if spec is None:
        try:
            spec = open_store(url, storage_options=storage_options).model_spec
        except StoreNotFoundError:
            raise IngestError(f"{url} holds no store yet: pass the model spec (--model-spec) to create it") from None
    keys.check_step(step)
    writer_id = keys.check_writer_id(writer_id or f"ingest-{source.fingerprint(step, topk_order)[:16]}")
    report = IngestReport(url=url, step=step, writer_id=writer_id)
    refused: set[str] = set()

    def count_absent(error: RoutingAbsentError) -> None:
        report.absent[error.reason] = report.absent.get(error.reason, 0) + 1

    on_absent = count_absent if skip_absent else None
    seen: set[str] = set()
    for record in source.records(spec, on_absent=on_absent, on_error=lambda exc: report.invalid.append(str(exc))):
        try:
            if record.sample_id in seen:
                raise IngestError(
                    f"sample {record.sample_id!r} appears twice in the input: both are refused (give each sample "
                    "its own id, e.g. with --sample-id-field)"
                )
            seen.add(record.sample_id)
            prepare_record(record, spec, step, topk_order)
        except (IngestError, InvalidRecordError) as exc:
            report.invalid.append(str(exc))
            refused.add(record.sample_id)
    if report.invalid and not partial:
        raise IngestError(
            f"{len(report.invalid)} record(s) or line(s) of the input are invalid; nothing was written (fix them and "
            f"run again, or --partial to write the valid ones). First: {report.invalid[0]}"
        )
    if not seen - refused:
        return report
    store = create_store(url, spec, storage_options=storage_options)
    report.absent.clear()
    writer = store.writer(
        step,
        writer_id,
        options=PartOptions(topk_order=topk_order, transform=codec),
        on_duplicate=on_duplicate,
        flush_bytes=flush_bytes,
        encode_threads=threads,
    )
    try:
        with interrupts.deferred() as interrupt, writer:
            for record in source.records(spec, on_absent=on_absent, on_error=lambda exc: None):
                interrupt.check()  # Ctrl-C lands here, between records, never inside the writer's locks
                if record.sample_id in refused:
                    continue
                writer.append(record)
                if progress is not None:
                    progress(writer.appended + len(writer.already_present))
    except KeyboardInterrupt:
        committed = sum(c.n_records for c in writer.commits)
        raise WriteInterruptedError(
            f"interrupted: {committed} records committed to step {step} of {store.url} in {len(writer.commits)} "
            "part(s); run the same command again to resume (it skips what is committed)"
        ) from None
    report.new, report.already_present, report.parts = writer.appended, len(writer.already_present), len(writer.commits)
    return report


def _json_lines(path: Path, on_error: Callable[[IngestError], None] | None = None) -> Iterator[tuple[str, Any]]:
    with path.open() as lines:
        for number, text in enumerate(lines, start=1):
            if not text.strip():
                continue
            where = f"{path}:{number}"
            try:
                yield where, load_json(text, where, max_bytes=MAX_LINE_BYTES)
            except ValueError as exc:
                error = IngestError(f"not a JSON line: {exc}")
                if on_error is None:
                    raise error from None
                on_error(error)


class NpzWriter:
    """Writes a ``.npz`` one array at a time, so exporting a large step holds one record in memory."""

    def __init__(self, path: Path) -> None:
        self._zip = zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED, allowZip64=True)

    def add(self, name: str, array: npt.ArrayLike) -> None:
        with self._zip.open(f"{name}.npy", "w", force_zip64=True) as member:
            np.lib.format.write_array(member, np.asanyarray(array), allow_pickle=False)

    def close(self) -> None:
        self._zip.close()


WIRE_LAYOUTS = ("vllm", "vllm-0.21", "sglang", "nemo-rl", "ms-swift", "megatron")
"""Layouts with an HTTP wire form, written as JSONL (one ``{"sample_id", "routed_experts", ...}`` line a record)."""
ARRAY_LAYOUTS = ("verl", "slime", "full", "moe", "vllm", "sglang")
"""Layouts written as ``.npz`` arrays."""


def export_step(
    snapshot: StepSnapshot,
    layout: ExportLayout,
    out: Path,
    *,
    sample_ids: Iterable[str] | None = None,
    batch_size: int = 64,
    prompt_length: int | None = None,
    response_length: int | None = None,
) -> int:
    """Write a step's records (or ``sample_ids``) in an engine layout; returns the number of records.

    ``.jsonl`` output holds one line per record, ``{"sample_id", "request", "response"}``: the response an engine
    client receives for it (its id the sample id, the token ids, the routing) and the request fields that shape it,
    which ``ingest --engine <layout>`` reads back to the same record: ``vllm`` (0.22+ base64 ``.npy``),
    ``vllm-0.21`` (nested lists, the prompt's rows in ``prompt_routed_experts``), ``sglang`` (``/generate``, base64
    int32 in ``meta_info``), ``nemo-rl`` (chat, ``nrlre1:`` envelope in the message) or ``ms-swift``
    (``__ndarray__`` object), rows from the record's payload start; ``megatron``: megatron-core's server response
    alone (``moe_topk_indices`` and the token ids in its one choice). These need the records' token ids.
    ``.npz`` output holds arrays: ``full`` / ``moe``: ``<sample_id>`` int16 ``[n_tokens, layers, K]``, -1 for
    missing rows and dense layers; ``vllm`` / ``sglang``: ``<sample_id>`` the engine's array; ``slime``:
    ``<sample_id>/<field>``; ``verl``: one batch padded to ``prompt_length`` + ``response_length`` (default: the
    longest prompt and response). Records stored as sorted sets (the default) keep their experts but not the
    engine's top-k order: ingest with ``topk_order="score"`` for a byte-identical export.
    """
    spec = snapshot.store.model_spec
    ids = list(sample_ids) if sample_ids is not None else snapshot.sample_ids
    if out.suffix == ".jsonl":
        if layout not in WIRE_LAYOUTS:
            raise IngestError(f"layout {layout!r} has no wire form; write it as .npz (one of {WIRE_LAYOUTS} as .jsonl)")
        with written_whole(out) as partial, partial.open("w") as lines:
            for start in range(0, len(ids), batch_size):
                for routing in snapshot.read_many(ids[start : start + batch_size]):
                    record = routing.to_record()
                    if layout == "sglang" and spec.indexer is not None:  # SGLang also returns the indexer's rows
                        record = _with_stored_indexer(snapshot, record)
                    lines.write(json.dumps(_wire(record, spec, layout)) + "\n")
        return len(ids)
    if layout not in ARRAY_LAYOUTS:
        raise IngestError(f"layout {layout!r} is a wire form: write it as .jsonl")
    with written_whole(out) as partial:
        _export_arrays(snapshot, layout, partial, ids, batch_size, prompt_length, response_length)
    return len(ids)


def _with_stored_indexer(snapshot: StepSnapshot, record: Record) -> Record:
    """``record`` with its stored indexer rows (as it is when it was stored without them)."""
    try:
        return replace(record, indexer=snapshot.read_indexer(record.sample_id))
    except ValuesNotFoundError:
        return record


def _export_arrays(
    snapshot: StepSnapshot,
    layout: ExportLayout,
    out: Path,
    ids: list[str],
    batch_size: int,
    prompt_length: int | None,
    response_length: int | None,
) -> None:
    """The ``.npz`` form of :func:`export_step`."""
    spec = snapshot.store.model_spec
    writer = NpzWriter(out)
    try:
        if layout == "verl":
            records = [r.to_record() for r in snapshot.read_many(ids)]
            batch = verl.to_batch(records, spec, prompt_length=prompt_length, response_length=response_length)
            for key, value in batch.items():
                writer.add(key, value)
            writer.add("sample_ids", np.asarray(ids, dtype=str))
            return
        for start in range(0, len(ids), batch_size):
            for routing in snapshot.read_many(ids[start : start + batch_size]):
                sid = routing.sample_id
                if layout == "moe":
                    writer.add(sid, routing.expert_ids)
                elif layout == "full":
                    writer.add(sid, to_full_axis(routing.expert_ids, spec, fill=-1))
                elif layout == "vllm":
                    writer.add(sid, vllm.to_array(routing.to_record(), spec))
                elif layout == "sglang":
                    writer.add(sid, sglang.to_array(routing.to_record(), spec))
                else:
                    for field, value in slime.to_sample(routing.to_record(), spec).items():
                        writer.add(f"{sid}/{field}", value)
    finally:
        writer.close()


def _wire(record: Record, spec: ModelSpec, layout: str) -> dict[str, Any]:
    """One JSONL line: ``{"sample_id", "request", "response"}``, the response as the engine's HTTP client receives
    it for this record (its id the sample id), the request the fields that shape it; ``ingest --engine <layout>``
    reads it back (megatron: the response alone, as its logs hold it)."""
    if layout == "megatron":
        sid = record.sample_id
        return {"id": sid, "sample_id": sid, "choices": [megatron_server.encode(record, spec)]}
    if record.token_ids is None:
        raise IngestError(
            f"sample {record.sample_id!r}: {layout}'s responses carry the token ids and the record was stored "
            "without them: write it as arrays instead (.npz: full, moe, vllm, sglang)"
        )
    tokens = np.asarray(record.token_ids, np.int64)
    prompt, output = tokens[: record.prompt_len].tolist(), tokens[record.prompt_len :].tolist()
    start = record.payload_start or 0
    if layout == "sglang":  # /generate: the request's input_ids and start offset, meta_info carrying the rows
        request: dict[str, Any] = {"input_ids": prompt, "return_routed_experts": True}
        if start:
            request["routed_experts_start_len"] = start
        meta = {
            "id": record.sample_id,
            "prompt_tokens": len(prompt),
            "completion_tokens": len(output),
            "routed_experts": sglang.to_meta_info(record, spec),
        }
        indexer = sglang.to_indexer_meta_info(record, spec)
        if indexer is not None:
            request["return_indexer_topk"] = True
            meta["indexer_topk"] = indexer
        response = {"output_ids": output, "meta_info": meta}
        return {"sample_id": record.sample_id, "request": request, "response": response}
    choice: dict[str, Any] = {"index": 0, "prompt_token_ids": prompt, "token_ids": output}
    response = {"id": record.sample_id, "object": "text_completion", "choices": [choice]}
    request = {"prompt": prompt, "return_token_ids": True}
    if layout == "vllm-0.21":  # the prompt's rows at the response's level, the generation's in the choice
        response["prompt_routed_experts"], choice["routed_experts"] = vllm.to_v021(record, spec)
        return {"sample_id": record.sample_id, "request": request, "response": response}
    if start and layout != "nemo-rl":  # NeMo-RL's envelope holds every row from the first, -1 where missing
        request["routed_experts_prompt_start"] = start
    if layout == "vllm":
        choice["routed_experts"] = vllm.to_http_choice(record, spec)
    elif layout == "ms-swift":
        choice["routed_experts"] = ms_swift.encode(vllm.to_array(record, spec))
    else:  # NeMo-RL: vLLM's chat response, the envelope and the token ids in the message
        del choice["prompt_token_ids"], choice["token_ids"]
        choice["message"] = {
            "role": "assistant",
            "prompt_token_ids": prompt,
            "generation_token_ids": output,
            "routed_experts": nemo_rl.encode(record, spec),
        }
        response["object"] = "chat.completion"
    return {"sample_id": record.sample_id, "request": request, "response": response}
