"""``routelog warm-up`` compiles every kernel that writing and reading a store use."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from routelog.cli import app
from routelog.format import ranked

# A fresh interpreter (no kernel compiled by another test): warm up, count each kernel's compiled signatures, then
# write and read stores through the public API on every warm-up path, and count again. Chunks of 64 rows split
# each record, so reads take windows of chunks into larger blocks as well as whole chunks.
_WRITE_AND_READ = r"""
import json
import numpy as np
from numba.core.registry import CPUDispatcher
import routelog
from routelog.format import _kernels, ranked

def compiled():
    return {name: len(f.signatures) for name, f in vars(_kernels).items() if isinstance(f, CPUDispatcher)}

ranked.warm_up()
before = compiled()
rng = np.random.default_rng(1)
for n, (experts, k) in enumerate(ranked.WARM_UP_PATHS.values()):
    spec = routelog.ModelSpec(name="toy", num_layers=6, moe_layers=tuple(range(6)), num_experts=experts, topk=k)
    url = f"memory://warm-up-{n}"
    records = [
        routelog.Record(
            sample_id=f"s{i}",
            expert_ids=np.argsort(rng.random((150, 6, experts)), axis=-1)[..., :k],
            prompt_len=50,
            response_len=100,
        )
        for i in range(3)
    ]
    options = routelog.PartOptions(chunk_rows=64)
    with routelog.open_writer(url, step=0, model_spec=spec, options=options) as writer:
        for record in records:
            writer.append(record)
    snapshot = routelog.open_store(url).step(0)
    for record in records:
        for layers in (None, [1, 2, 5]):
            got = snapshot.read(record.sample_id, moe_layers=layers).expert_ids
            want = record.expert_ids if layers is None else record.expert_ids[:, layers]
            assert (np.sort(got, axis=-1) == np.sort(want, axis=-1)).all()
print(json.dumps({"before": before, "after": compiled()}))
"""


def test_warm_up_compiles_what_writing_and_reading_use() -> None:
    """After :func:`routelog.format.ranked.warm_up`, writing and reading stores compiles nothing more."""
    run = subprocess.run(
        [sys.executable, "-c", _WRITE_AND_READ], capture_output=True, text=True, timeout=600, check=False
    )
    assert run.returncode == 0, run.stderr[-3000:]
    counts = json.loads(run.stdout.strip().splitlines()[-1])
    assert counts["before"]["encode_chunk"] == len(ranked.WARM_UP_PATHS)  # one per path, none missing
    assert counts["after"] == counts["before"]


def test_the_command_reports_every_path() -> None:
    result = CliRunner().invoke(app, ["warm-up", "--json"])
    assert result.exit_code == 0, result.output
    assert set(json.loads(result.stdout)["seconds"]) == set(ranked.WARM_UP_PATHS)


def test_each_routing_takes_the_path_warmed_for_it() -> None:
    for path, (experts, k) in ranked.WARM_UP_PATHS.items():
        assert ranked.kernel_path(experts, k) == path
    assert ranked.kernel_path(256, 8) == "uint8 IDs, K = 8"  # IDs 0..255 still fit a byte
    assert ranked.kernel_path(256, 2) == "uint8 IDs, other K"
    assert ranked.kernel_path(257, 8) == ranked.kernel_path(1024, 3) == "uint16 IDs"


def test_an_unknown_path_is_refused_naming_the_known_ones() -> None:
    with pytest.raises(ValueError, match="uint16 IDs"):
        ranked.warm_up(["uint32 IDs"])
