"""Shared fixtures: a real S3 (moto server over HTTP on 127.0.0.1, and a fault-injecting proxy in front of it),
store URLs on every backend, small specs."""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, settings

from routelog import ModelSpec
from routelog.fault_proxy import FaultProxy
from routelog.synth import synthetic_spec
from routelog.testing import local_s3_server
from tests.records import random_routing

settings.register_profile("default", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("ci", parent=settings.get_profile("default"), derandomize=True)
settings.register_profile("nightly", parent=settings.get_profile("default"), max_examples=1000)
# Mutation checks of the protocol test: the CI examples, reported without shrinking (a failure is all they ask).
settings.register_profile("ci-unshrunk", parent=settings.get_profile("ci"), phases=[Phase.explicit, Phase.generate])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "default"))

S3_ENV = {
    "AWS_ACCESS_KEY_ID": "routelog-test",
    "AWS_SECRET_ACCESS_KEY": "routelog-test",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """One moto S3 server per session on a free loopback port (conditional writes atomic, as on S3); the AWS_*
    environment points at it."""
    with local_s3_server() as endpoint:
        saved = {k: os.environ.get(k) for k in [*S3_ENV, "AWS_ENDPOINT_URL", "AWS_PROFILE"]}
        os.environ.update(S3_ENV, AWS_ENDPOINT_URL=endpoint)
        os.environ.pop("AWS_PROFILE", None)
        yield endpoint
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture
def s3_bucket(s3_endpoint: str) -> str:
    """A fresh bucket on the moto server."""
    import boto3

    name = f"routelog-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_endpoint).create_bucket(Bucket=name)
    return name


@pytest.fixture(params=["memory", "local", "s3"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A store URL that does not exist yet, on each backend (the shared store suite runs on all three)."""
    if request.param == "memory":
        return f"memory://routelog-tests/{uuid.uuid4().hex}"
    if request.param == "local":
        return f"file://{tmp_path}/store"
    bucket = request.getfixturevalue("s3_bucket")
    return f"s3://{bucket}/runs/{uuid.uuid4().hex[:8]}"


@pytest.fixture
def memory_url() -> str:
    return f"memory://routelog-tests/{uuid.uuid4().hex}"


@pytest.fixture
def small_spec() -> ModelSpec:
    return synthetic_spec(layers=6, experts=32, topk=4)


@pytest.fixture
def dense_first_spec() -> ModelSpec:
    """DeepSeek-V3 style: three dense layers first, then MoE."""
    return ModelSpec.from_hf_config(
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


@pytest.fixture
def make_routing() -> Callable[..., np.ndarray]:
    return random_routing


@pytest.fixture(scope="session")
def megatron_env() -> None:
    """megatron-core 0.16 on CPU (:func:`routelog.testing.megatron_on_cpu`)."""
    pytest.importorskip("megatron.core")
    from routelog.testing import megatron_on_cpu

    megatron_on_cpu()


@pytest.fixture(scope="session")
def ray_cluster(s3_endpoint: str) -> Iterator[None]:
    """One local Ray cluster per test session (2 CPUs); workers inherit the moto S3 environment."""
    ray = pytest.importorskip("ray")
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
        runtime_env={"env_vars": {k: os.environ[k] for k in [*S3_ENV, "AWS_ENDPOINT_URL"]}},
    )
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def s3_fault_proxy(s3_endpoint: str) -> Iterator[FaultProxy]:
    """A fault-injecting proxy in front of the session's moto server (:mod:`routelog.fault_proxy`); point an S3
    client's ``endpoint_url`` at ``.endpoint``. Shared: a test that injects faults calls ``clear()`` before and
    after."""
    with FaultProxy(upstream=s3_endpoint) as proxy:
        yield proxy


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """How much of the store protocol the model-based test ran (``tests/test_protocol.py``)."""
    protocol = sys.modules.get("tests.test_protocol")
    for backend, runs in getattr(protocol, "RUNS", {}).items():
        terminalreporter.write_line(
            f"protocol model: {len(runs)} interleavings, {sum(runs)} operations on {backend}, every view checked "
            "after each"
        )


@pytest.fixture
def verl_patched(monkeypatch: pytest.MonkeyPatch) -> None:
    """veRL's own RouterReplay patch of megatron-core (undone after the test)."""
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher
    from megatron.core.transformer.transformer_config import TransformerConfig
    from verl.utils.megatron.router_replay_patch import apply_router_replay_patch

    for cls, names in (
        (TopKRouter, ("__init__", "routing", "_router_replay_patched")),
        (TransformerConfig, ("__init__", "_verl_router_patched")),
        (MoEAlltoAllTokenDispatcher, ("preprocess", "_preprocess_patched")),
    ):
        for name in names:
            monkeypatch.setattr(cls, name, getattr(cls, name, None), raising=False)
            if getattr(cls, name) is None:
                monkeypatch.delattr(cls, name)
    # veRL also rewrites the config constructor's signature object in place: keep the original's.
    monkeypatch.setattr(TransformerConfig.__init__, "__signature__", None, raising=False)
    apply_router_replay_patch()
