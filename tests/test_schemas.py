"""The JSON Schemas in schemas/ are generated from the models; this fails when the two drift apart."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

import routelog
from routelog.format.documents import DOCUMENT_MODELS, INDEX_SCHEMA, json_schemas

SCHEMAS = Path(__file__).resolve().parent.parent / "schemas"


@pytest.mark.parametrize("name", sorted(DOCUMENT_MODELS))
def test_committed_schema_matches_the_model(name: str) -> None:
    committed = json.loads((SCHEMAS / f"{name}.schema.json").read_text())
    assert committed == json_schemas()[name], f"run: python tools/gen_schemas.py (schemas/{name}.schema.json)"


def test_no_stray_schema_files() -> None:
    assert {p.name for p in SCHEMAS.glob("*.schema.json")} == {f"{n}.schema.json" for n in DOCUMENT_MODELS}


def test_written_documents_validate_against_the_schemas(memory_url: str, small_spec: routelog.ModelSpec) -> None:
    store = routelog.create_store(memory_url, small_spec, config={"seed": 1})
    with store.writer(0, "w") as writer:
        writer.append(routelog.Record(sample_id="a", expert_ids=[[[0, 1, 2, 3]] * 6] * 2, prompt_len=1, response_len=1))
    schemas = json_schemas()
    jsonschema.validate(json.loads(store.storage.read("routelog.json")), schemas["run"])
    (commit,) = store.step(0).commits
    jsonschema.validate(json.loads(commit.model_dump_json()), schemas["commit"])
    jsonschema.validate(json.loads(store.step(0).info("a").model_dump_json()), schemas["index_row"])


def test_parquet_columns_follow_the_index_row_model() -> None:
    assert INDEX_SCHEMA.names == list(DOCUMENT_MODELS["index_row"].model_fields)
