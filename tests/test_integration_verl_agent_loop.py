"""veRL 0.9.1's agent-loop workers write the routing themselves (routelog.integrations.verl_agent_loop), on both of
veRL's paths, with no driver code.

veRL's own ``AgentLoopWorker._run_agent_loop`` runs a registered agent loop whose ``run`` returns prepared
``AgentLoopOutput`` objects (the engine's routing as vLLM returns it: ``[n - 1, layers, K]``); then veRL's own
postprocessing builds what its trainers receive: the legacy worker's padded outputs and ``_postprocess`` batch, or
the V1 worker's TransferQueue fields (the put itself is captured: no TransferQueue service runs here). A control
run without routelog gives veRL's own dense ``routed_experts``; with routelog that tensor is gone, the batch
carries ids, and the training side installs exactly the control's routes at every token.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

import routelog
from tests.test_integration_verl import (
    L_FULL,
    PROMPT,
    PROMPTS,
    RESPONSE,
    RESPONSES,
    replay_micro_batches,
    restore_engine,
)
from tests.test_megatron import SPEC

pytestmark = [
    pytest.mark.usefixtures("megatron_env"),
    pytest.mark.verl,
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]
torch = pytest.importorskip("torch")
pytest.importorskip("verl")
pytest.importorskip("hydra")
agent_loop = pytest.importorskip("verl.experimental.agent_loop.agent_loop")

STEP = 7
OUTPUTS: dict[str, Any] = {}
"""What the registered agent loop returns, by ``<uid>/<session>``."""


@agent_loop.register("routelog_prepared")
class PreparedAgentLoop(agent_loop.AgentLoopBase):  # type: ignore[misc]
    """An agent loop whose trajectory is already generated (what an engine would have returned)."""

    def __init__(self, **kwargs: Any) -> None:
        del kwargs

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> Any:
        return OUTPUTS[kwargs["prepared"]].model_copy(deep=True)


def tokenizer() -> Any:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {"[PAD]": 0, "[UNK]": 1, **{f"t{i}": i for i in range(2, 64)}}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="[UNK]")), pad_token="[PAD]")


def worker(cls: type) -> Any:
    """A worker as far as veRL's ``_run_agent_loop`` and postprocessing use it (no LLM servers, reward or
    teacher models, multi-modal processor)."""
    one = object.__new__(cls)
    one.__dict__.update(
        config=SimpleNamespace(data={}),
        llm_client=None,
        tokenizer=tokenizer(),
        processor=None,
        hf_model_type=None,
        dataset_cls=None,
        tools=[],
        rollout_config=SimpleNamespace(prompt_length=PROMPT, response_length=RESPONSE),
        reward_loop_worker_handles=None,
        distillation_enabled=False,
        mm_processor_kwargs=None,
    )
    return one


def prepare(rng: np.random.Generator) -> list[str]:
    """One trajectory per (prompt, response) length: random tokens and full-axis routes for the ``n - 1`` tokens
    the engine fed (dense layers zero); two sessions per uid. Returns the keys in batch order."""
    OUTPUTS.clear()
    keys = []
    for i, (p, r) in enumerate(zip(PROMPTS, RESPONSES, strict=True)):
        routes = np.zeros((p + r - 1, L_FULL, SPEC.topk), np.int32)
        keys_ = np.argsort(rng.random((p + r - 1, SPEC.num_moe_layers, SPEC.num_experts)), axis=-1)[..., : SPEC.topk]
        routes[:, list(SPEC.moe_layers)] = keys_
        key = f"u{i // 2}/{i % 2}"
        OUTPUTS[key] = agent_loop.AgentLoopOutput(
            prompt_ids=rng.integers(2, 64, p).tolist(),
            response_ids=rng.integers(2, 64, r).tolist(),
            response_mask=[1] * r,
            routed_experts=routes,
            metrics=agent_loop.AgentLoopMetrics(),
            num_turns=2,
        )
        keys.append(key)
    return keys


@pytest.fixture
def unpatched(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every method routelog's agent-loop install wraps is restored after the test."""
    from routelog.integrations import verl_agent_loop

    modules = [agent_loop]
    v1 = _v1()
    if v1 is not None:
        modules.append(v1)
    for module in modules:
        for name in ("AgentLoopWorker", "AgentLoopWorkerTQ"):
            for cls in verl_agent_loop._classes(getattr(module, name, None)):
                for method in ("_run_agent_loop", "_agent_loop_postprocess"):
                    if method in vars(cls):
                        monkeypatch.setattr(cls, method, vars(cls)[method])


def _v1() -> Any:
    try:
        from verl.trainer.ppo.v1 import agent_loop_tq
    except ImportError:
        return None
    return agent_loop_tq


def legacy_batch(keys: list[str]) -> Any:
    """veRL's legacy flow: each trajectory through ``_run_agent_loop`` (its postprocess padding it), then the
    worker's ``_postprocess`` into the ``DataProto`` the driver receives."""
    one = worker(agent_loop.AgentLoopWorker)

    async def run() -> list[Any]:
        outs = []
        for position, key in enumerate(keys):
            uid, session = key.split("/")
            trajectory = {"step": STEP, "sample_index": position // 2, "rollout_n": int(session), "validate": False}
            outs.append(
                await one._run_agent_loop(
                    {}, trajectory, agent_name="routelog_prepared", trace=False, uid=uid, raw_prompt=[], prepared=key
                )
            )
        return outs

    return one._postprocess(asyncio.run(run()))


def test_the_legacy_workers_write_the_routing_and_the_trainer_replays_it(
    verl_patched: None, monkeypatch: pytest.MonkeyPatch, unpatched: None
) -> None:
    from routelog.integrations import verl as integration
    from routelog.integrations import verl_agent_loop
    from routelog.integrations.verl import SAMPLE_ID_KEY, STEP_KEY

    keys = prepare(np.random.default_rng(11))
    control = legacy_batch(keys)  # veRL alone: the dense routes travel in the batch
    routes = control.batch["routed_experts"].numpy().copy()
    assert routes.shape == (len(keys), PROMPT + RESPONSE, L_FULL, SPEC.topk)

    url = f"memory://verl-agent-loop/{uuid.uuid4().hex}"
    routelog.create_store(url, SPEC)
    routing = verl_agent_loop.install(url)
    batch = legacy_batch(keys)
    assert "routed_experts" not in batch.batch, "the dense tensor no longer travels"
    assert list(batch.non_tensor_batch[SAMPLE_ID_KEY]) == keys
    assert set(batch.non_tensor_batch[STEP_KEY]) == {STEP}
    assert routing.written == len(keys)
    snapshot = routelog.open_store(url).step(STEP)
    assert sorted(snapshot.sample_ids) == sorted(keys)
    for position, key in enumerate(keys):
        record = snapshot.read(key)
        out = OUTPUTS[key]
        assert record.info.policy_version == STEP
        assert list(record.info.token_ids) == out.prompt_ids + out.response_ids
        np.testing.assert_array_equal(
            record.expert_ids[:-1], np.sort(out.routed_experts[:, list(SPEC.moe_layers)], axis=-1)
        )
        assert not record.valid[-1]
        np.testing.assert_array_equal(batch.batch["input_ids"][position], control.batch["input_ids"][position])

    restore_engine(monkeypatch)
    replay = integration.install(url)
    try:
        replay_micro_batches(replay, batch, routes, fp8=None, max_token_len=24, prefetch=True)
        assert replay.end_step(phase="train").samples == len(keys)
    finally:
        replay.remove()


def test_the_v1_workers_put_ids_not_routes_into_transfer_queue(
    unpatched: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """veRL's V1 worker (a Ray actor class from its definition): the fields it puts into TransferQueue carry the
    record ids in ``extra_fields`` and no ``routed_experts``; the training side reads them from there. Ray's copy
    of the class, which actor processes run, carries routelog's wrapper through pickling."""
    v1 = _v1()
    if v1 is None:
        pytest.skip("TransferQueue is not installed")
    from verl.utils import tensordict_utils as tu

    from routelog.integrations import verl_agent_loop
    from routelog.integrations.verl import SAMPLE_ID_KEY, carried_ids

    put: dict[str, Any] = {}

    async def async_kv_batch_put(keys: list[str], fields: Any, tags: list[Any], partition_id: str) -> None:
        put.setdefault("keys", []).extend(keys)
        put.setdefault("fields", []).append(fields)

    monkeypatch.setattr(v1.tq, "async_kv_batch_put", async_kv_batch_put)
    keys = prepare(np.random.default_rng(12))
    url = f"memory://verl-agent-loop/{uuid.uuid4().hex}"
    routelog.create_store(url, SPEC)
    verl_agent_loop.install(url)
    actor_class = v1.AgentLoopWorkerTQ.__ray_metadata__.modified_class
    one = worker(actor_class)  # the class an actor runs: Ray's copy, with its own methods

    async def run() -> None:
        for key in keys:
            uid, session = key.split("/")
            trajectory = {"step": STEP, "sample_index": 0, "rollout_n": 0, "validate": False}
            await one._run_agent_loop(
                {},
                trajectory=trajectory,
                agent_name="routelog_prepared",
                trace=False,
                session_id=int(session),
                uid=uid,
                global_steps=STEP,
                raw_prompt=[],
                prepared=key,
            )

    asyncio.run(run())
    assert put["keys"] == [f"{k.replace('/', '_')}_0" for k in keys]  # veRL's own TransferQueue keys
    for key, fields in zip(keys, put["fields"], strict=True):
        assert "routed_experts" not in fields, "the dense tensor no longer travels"
        assert tu.get(fields, "extra_fields")[0][SAMPLE_ID_KEY] == key
        assert carried_ids(fields) == ((key,), STEP)  # what the training side reads from the V1 batch
    snapshot = routelog.open_store(url).step(STEP)
    assert sorted(snapshot.sample_ids) == sorted(keys)
    for key in keys:
        out = OUTPUTS[key]
        np.testing.assert_array_equal(
            snapshot.read(key).expert_ids[:-1], np.sort(out.routed_experts[:, list(SPEC.moe_layers)], axis=-1)
        )


def test_rays_copy_of_the_v1_worker_class_carries_the_wrapper_to_an_actor_process(
    unpatched: None, tmp_path: Path
) -> None:
    """Ray ships ``AgentLoopWorkerTQ``'s class to each actor process by value (cloudpickle): unpickled in a fresh
    process, its methods are still routelog's wrappers, with the store's URL and nothing opened."""
    v1 = _v1()
    if v1 is None:
        pytest.skip("TransferQueue is not installed")
    from ray import cloudpickle

    from routelog.integrations import verl_agent_loop

    url = str(tmp_path / "store")
    routelog.create_store(url, SPEC)
    verl_agent_loop.install(url)
    shipped = tmp_path / "class.pkl"
    shipped.write_bytes(cloudpickle.dumps(v1.AgentLoopWorkerTQ.__ray_metadata__.modified_class))
    probe = (
        "import pickle, sys\n"
        "from routelog.integrations import verl_agent_loop as m\n"
        "cls = pickle.loads(open(sys.argv[1], 'rb').read())\n"
        "post, run = vars(cls)['_agent_loop_postprocess'], vars(cls)['_run_agent_loop']\n"
        "assert isinstance(post, m._Postprocess) and isinstance(run, m._RunAgentLoop), (post, run)\n"
        "assert post.routing._store == sys.argv[2] and post.routing._recorder is None\n"
        "print('shipped')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "ROUTELOG_URL"}
    result = subprocess.run(
        [sys.executable, "-c", probe, str(shipped), url],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert result.returncode == 0 and "shipped" in result.stdout, result.stderr[-2000:]


def test_concurrent_trajectories_share_commits_and_each_waits_for_its_own(unpatched: None) -> None:
    """A worker runs its trajectories concurrently: their records are group-committed (fewer parts than
    trajectories), each postprocessing returns only once its record is readable; a trajectory postprocessed again
    (a retried task) finds its record already there, and one generated again with other tokens gets the next
    attempt's id, which it carries to the trainer."""
    from routelog.integrations import verl_agent_loop
    from routelog.integrations.verl import SAMPLE_ID_KEY

    keys = prepare(np.random.default_rng(13))
    url = f"memory://verl-agent-loop/{uuid.uuid4().hex}"
    store = routelog.create_store(url, SPEC)
    verl_agent_loop.install(url)
    one = worker(agent_loop.AgentLoopWorker)

    async def trajectory(position: int, key: str) -> Any:
        uid, session = key.split("/")
        trajectory = {"step": STEP, "sample_index": position // 2, "rollout_n": int(session), "validate": False}
        out = await one._run_agent_loop(
            {}, trajectory, agent_name="routelog_prepared", trace=False, uid=uid, raw_prompt=[], prepared=key
        )
        sid = out.extra_fields[SAMPLE_ID_KEY]
        assert sid in store.step(STEP), "handed on only once its routing is committed"
        return sid

    async def run() -> list[Any]:
        return await asyncio.gather(*(trajectory(p, k) for p, k in enumerate(keys)))

    assert asyncio.run(run()) == keys
    commits = store.step(STEP).commits
    assert 1 <= len(commits) < len(keys), f"{len(commits)} parts for {len(keys)} trajectories"
    assert asyncio.run(trajectory(0, keys[0])) == keys[0]  # retried: already there, returns at once
    assert len(store.step(STEP).commits) == len(commits)
    OUTPUTS[keys[0]].response_ids = [int(t) % 62 + 2 for t in np.add(OUTPUTS[keys[0]].response_ids, 1)]
    assert asyncio.run(trajectory(0, keys[0])) == f"{keys[0]}#1", "regenerated: the next attempt's id"
    again = store.step(STEP).read(f"{keys[0]}#1")
    assert list(again.info.token_ids) == OUTPUTS[keys[0]].prompt_ids + OUTPUTS[keys[0]].response_ids


def test_a_later_step_closes_the_earlier_writer_without_blocking_its_commits() -> None:
    """Trajectories of two global steps finish together in one process: the later step's first record closes the
    earlier step's writer while that writer's part is still committing (its commit calls back into the recorder):
    both records are committed and both postprocessings return."""
    from routelog.integrations.verl_agent_loop import AgentLoopRecorder, record_of

    keys = prepare(np.random.default_rng(14))
    url = f"memory://verl-agent-loop/{uuid.uuid4().hex}"
    store = routelog.create_store(url, SPEC)
    recorder = AgentLoopRecorder(store)

    async def write(key: str, step: int) -> str:
        return await recorder.write(record_of(OUTPUTS[key], key, SPEC, step), step)

    async def run() -> list[str]:
        earlier = asyncio.ensure_future(write(keys[0], STEP))
        await asyncio.sleep(0.05)  # appended, its part not yet flushed (group commit every 0.2 s)
        later = await asyncio.wait_for(write(keys[1], STEP + 1), timeout=60)  # closes the earlier step's writer
        return [await asyncio.wait_for(earlier, timeout=60), later]

    assert asyncio.run(run()) == keys[:2]
    recorder.close()
    assert store.step(STEP).sample_ids == [keys[0]]
    assert store.step(STEP + 1).sample_ids == [keys[1]]
