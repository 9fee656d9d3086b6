"""Audits: numbers checked against brute force on the records written, independence from how the work is split,
identical numbers on a real local Ray cluster, and every figure rendered."""

from __future__ import annotations

import json
import math
import threading
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

import routelog
from routelog import ModelSpec, Record, audit
from routelog.audit.diff import TokenMismatchError
from routelog.audit.figures import diff_figure, drift_figure, mismatch_figure, stats_figure
from routelog.audit.r3 import extreme_fraction, k3_kl, routing_differences
from routelog.audit.units import batches
from routelog.cli import app
from routelog.format.values import LOGPROB_INFER, LOGPROB_TRAIN

SPEC = ModelSpec(name="audit", num_layers=5, moe_layers=(0, 2, 3, 4), num_experts=16, topk=3)


def make_records(n: int, seed: int, skew: float = 0.0) -> list[Record]:
    rng = np.random.default_rng(seed)
    popularity = rng.dirichlet(np.full(SPEC.num_experts, 1 / skew)) if skew else None
    out = []
    for i in range(n):
        tokens = int(rng.integers(8, 40))
        scores = rng.random((tokens, SPEC.num_moe_layers, SPEC.num_experts))
        if popularity is not None:
            scores = scores * popularity
        valid = np.ones(tokens, bool)
        valid[-1] = False
        infer = np.full(tokens, np.nan, np.float32)
        infer[4:] = np.log(rng.beta(4, 1, tokens - 4) + 1e-6)
        out.append(
            Record(
                sample_id=f"r{i:03d}",
                expert_ids=np.argsort(-scores, -1)[..., : SPEC.topk],
                prompt_len=4,
                response_len=tokens - 4,
                valid=valid,
                token_ids=rng.integers(0, 500, tokens),
                token_values={LOGPROB_INFER: infer},
            )
        )
    return out


def perturb(records: list[Record], rate: float, seed: int) -> list[Record]:
    """The same records with about ``rate`` of router decisions changed in one expert."""
    rng = np.random.default_rng(seed)
    out = []
    for record in records:
        ids = record.expert_ids.copy()
        for t, layer in zip(*np.nonzero(rng.random(ids.shape[:2]) < rate), strict=True):
            free = np.setdiff1d(np.arange(SPEC.num_experts), ids[t, layer])
            ids[t, layer, 0] = rng.choice(free)
        out.append(
            Record(
                sample_id=record.sample_id,
                expert_ids=ids,
                prompt_len=record.prompt_len,
                response_len=record.response_len,
                valid=record.valid,
                token_ids=record.token_ids,
            )
        )
    return out


def write(url: str, steps: dict[int, list[Record]], train_noise: float | None = None) -> routelog.Store:
    store = routelog.create_store(url, SPEC)
    for step, records in steps.items():
        with store.writer(step, "w", flush_bytes=4 << 10) as writer:  # several parts per step
            for record in records:
                writer.append(record)
        if train_noise is not None:
            rng = np.random.default_rng(step)
            with store.annotate(step, "trainer") as annotator:
                for record in records[:-2]:  # two records the trainer never scored
                    infer = record.token_values[LOGPROB_INFER]  # type: ignore[index]
                    annotator.add(
                        record.sample_id,
                        {LOGPROB_TRAIN: np.minimum(infer + rng.normal(0, train_noise * (step + 1), infer.shape), 0)},
                    )
    return store


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("audit")
    steps = {0: make_records(30, 0), 1: make_records(25, 1, skew=0.5), 2: make_records(20, 2, skew=0.2)}
    a = write(str(root / "a"), steps, train_noise=0.2)
    b_steps = {1: perturb(steps[1], 0.15, 7)[:-3] + make_records(2, 99)[:0]}
    b = write(str(root / "b"), b_steps)
    return {"a": str(root / "a"), "b": str(root / "b"), "steps": steps, "b_steps": b_steps, "store_a": a, "store_b": b}


def brute_counts(records: list[Record]) -> np.ndarray:
    counts = np.zeros((SPEC.num_moe_layers, SPEC.num_experts), np.int64)
    for record in records:
        ids = record.expert_ids[record.valid]
        for j in range(SPEC.num_moe_layers):
            counts[j] += np.bincount(ids[:, j].ravel(), minlength=SPEC.num_experts)
    return counts


def test_stats_match_brute_force(runs: dict[str, object]) -> None:
    steps = runs["steps"]
    assert isinstance(steps, dict)
    result = audit.stats(str(runs["a"]), unit_records=7, batch_records=3)
    counts = sum(brute_counts(r) for r in steps.values())
    assert [layer.load for layer in result.layers] == counts.tolist()
    assert [layer.layer for layer in result.layers] == list(SPEC.moe_layers)
    assert result.records == sum(len(r) for r in steps.values())
    assert result.rows == sum(int(r.valid.sum()) for rs in steps.values() for r in rs)  # type: ignore[union-attr]
    for layer, load in zip(result.layers, counts, strict=True):
        p = load / load.sum()
        assert layer.imbalance == pytest.approx(load.max() / load.mean())
        assert layer.cv == pytest.approx(load.std() / load.mean())
        assert layer.entropy_bits == pytest.approx(-(p[p > 0] * np.log2(p[p > 0])).sum())
        assert 0 < layer.entropy_normalized <= 1
    assert result.bytes_per_token_layer > 0
    only_step_1 = audit.stats(str(runs["a"]), [1])
    assert [layer.load for layer in only_step_1.layers] == brute_counts(steps[1]).tolist()


def test_results_do_not_depend_on_how_the_work_is_split(runs: dict[str, object]) -> None:
    url = str(runs["a"])
    assert audit.stats(url, unit_records=1, batch_records=1) == audit.stats(url, unit_records=1000, batch_records=64)
    assert audit.mismatch(url, unit_records=1) == audit.mismatch(url, unit_records=1000)
    assert audit.diff(url, str(runs["b"]), 1, unit_records=2) == audit.diff(url, str(runs["b"]), 1, unit_records=500)


def test_diff_matches_brute_force(runs: dict[str, object]) -> None:
    steps, b_steps = runs["steps"], runs["b_steps"]
    assert isinstance(steps, dict) and isinstance(b_steps, dict)
    result = audit.diff(str(runs["a"]), str(runs["b"]), 1, unit_records=6)
    router = np.zeros(SPEC.topk + 1, np.int64)
    per_layer = np.zeros(SPEC.num_moe_layers, np.int64)
    token_rates, seq = [], []
    for left, right in zip(steps[1], b_steps[1], strict=False):
        counts = routing_differences(left.expert_ids[left.valid], right.expert_ids[right.valid])
        router += np.bincount(counts.ravel(), minlength=SPEC.topk + 1)
        per_layer += (counts > 0).sum(0)
        token_rates.extend((counts.sum(1) > 0).tolist())
        seq.append(counts.sum(1).mean())
    assert result.router_hist == router.tolist()
    assert result.records_compared == len(b_steps[1]) and result.only_a == 3 and result.only_b == 0
    assert result.router_diff_rate == pytest.approx(router[1:].sum() / router.sum())
    assert 0.10 < result.router_diff_rate < 0.20  # about the 15 % injected
    assert result.token_diff_rate == pytest.approx(np.mean(token_rates))
    assert result.mean_sequence_diff == pytest.approx(np.mean(seq))
    assert [layer.diff_rate for layer in result.layers] == pytest.approx(
        (per_layer / router.sum() * SPEC.num_moe_layers).tolist()
    )
    same = audit.diff(str(runs["a"]), str(runs["a"]), 1)
    assert same.router_diff_rate == 0 and same.router_hist[1:] == [0] * SPEC.topk


def test_diff_refuses_records_with_different_tokens(tmp_path: Path) -> None:
    records = make_records(4, 0)
    other = make_records(4, 0)
    other[2] = Record(
        sample_id=other[2].sample_id,
        expert_ids=other[2].expert_ids,
        prompt_len=other[2].prompt_len,
        response_len=other[2].response_len,
        token_ids=np.asarray(other[2].token_ids) + 1,
    )
    write(str(tmp_path / "a"), {0: records})
    write(str(tmp_path / "b"), {0: other})
    with pytest.raises(TokenMismatchError) as info:
        audit.diff(str(tmp_path / "a"), str(tmp_path / "b"), 0)
    assert info.value.sample_id == "r002" and info.value.field == "token_hash"
    assert f"{tmp_path / 'a'} step 0" in str(info.value) and f"{tmp_path / 'b'} step 0" in str(info.value)


def test_mismatch_matches_the_metrics_on_the_stored_logprobs(runs: dict[str, object]) -> None:
    store = runs["store_a"]
    assert isinstance(store, routelog.Store)
    result = audit.mismatch(str(runs["a"]), unit_records=4)
    assert [s.step for s in result.steps] == [0, 1, 2]
    kls = []
    for row in result.steps:
        snapshot = store.step(row.step)
        values = snapshot.token_values(snapshot.sample_ids, [LOGPROB_INFER, LOGPROB_TRAIN])
        pairs = [(v[LOGPROB_TRAIN], v[LOGPROB_INFER]) for v in values.values() if LOGPROB_TRAIN in v]
        train = np.concatenate([t for t, _ in pairs]).astype(np.float64)
        infer = np.concatenate([i for _, i in pairs]).astype(np.float64)
        keep = np.isfinite(train) & np.isfinite(infer)
        assert row.records == len(pairs) == len(snapshot) - 2
        assert row.tokens == int(keep.sum())
        assert row.kl_k3 == pytest.approx(k3_kl(train[keep], infer[keep]), rel=1e-12)
        for t in (1.5, 2.0, 5.0):
            assert row.extreme[f"{t:g}"] == pytest.approx(extreme_fraction(train[keep], infer[keep], t))
        kls.append(row.kl_k3)
    assert kls == sorted(kls)  # the noise grows with the step


def test_drift_between_steps_and_runs(runs: dict[str, object]) -> None:
    steps = runs["steps"]
    assert isinstance(steps, dict)
    result = audit.drift(str(runs["a"]), other=str(runs["b"]))
    assert [(p.a, p.b) for p in result.consecutive] == [("step 0", "step 1"), ("step 1", "step 2")]
    expected = audit.js_divergence(brute_counts(steps[0]), brute_counts(steps[1]))
    assert result.consecutive[0].js == pytest.approx(expected.tolist())
    assert len(result.between_runs) == 1 and result.between_runs[0].a.endswith("step 1")
    # a uniform step vs a strongly skewed one drifts more than two near-identical runs of the same step
    assert result.consecutive[0].mean_js > result.between_runs[0].mean_js
    assert float(audit.js_divergence([1, 0], [0, 1])) == 1.0
    assert float(audit.js_divergence([3, 1], [6, 2])) == 0.0


@pytest.mark.usefixtures("ray_cluster")
def test_ray_gives_the_same_numbers(runs: dict[str, object]) -> None:
    a, b = str(runs["a"]), str(runs["b"])
    assert audit.stats(a, unit_records=8, use_ray=True) == audit.stats(a, unit_records=8)
    assert audit.diff(a, b, 1, unit_records=5, use_ray=True) == audit.diff(a, b, 1, unit_records=5)
    assert audit.mismatch(a, unit_records=3, use_ray=True) == audit.mismatch(a, unit_records=17)
    assert audit.drift(a, other=b, use_ray=True) == audit.drift(a, other=b)


def test_every_figure_renders(runs: dict[str, object], tmp_path: Path) -> None:
    import matplotlib.image

    a, b = str(runs["a"]), str(runs["b"])
    figures = {
        "stats": lambda p: stats_figure(audit.stats(a), p),
        "diff": lambda p: diff_figure(audit.diff(a, b, 1), p),
        "mismatch": lambda p: mismatch_figure(audit.mismatch(a), p),
        "drift": lambda p: drift_figure(audit.drift(a, other=b), p),
    }
    for name, draw in figures.items():
        path = tmp_path / f"{name}.png"
        draw(path)
        height, width, _ = matplotlib.image.imread(path).shape
        assert width > 800 and height > 300, name


def test_figures_handle_zeros_single_steps_and_integer_counts(runs: dict[str, object], tmp_path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from routelog.audit.figures import count_bars, value_axis

    fig, axes = plt.subplots(1, 6)
    cases = ([0.0, 1e-3, 0.2], [1e-3, 0.2], [0.0, 0.0], [3.97062e-3, 3.97069e-3], [0.0, 0.1, 0.15])
    for ax, values, scale in zip(axes[:5], cases, ("symlog", "log", "linear", "linear", "linear"), strict=True):
        assert value_axis(ax, np.asarray(values)) == scale, values
        assert ax.get_yscale() == scale, values
        if scale == "linear":  # from 0 (a zero just above the frame), the largest value inside
            low, high = ax.get_ylim()
            assert -0.05 * high <= low <= 0 and high > max(values), values
    axes = axes[5:]
    count_bars(axes[0], {"a": np.array([90, 8, 2]), "b": np.array([100])}, title="t", xlabel="x")
    assert list(axes[0].get_xticks()) == [0, 1, 2], "integer counts get integer ticks"
    assert axes[0].get_yscale() == "log" and "log" in axes[0].get_ylabel(), "a log axis says so"
    assert sorted(t.get_text() for t in axes[0].texts) == ["100%", "2%", "8%", "90%"], "each share printed"
    plt.close(fig)
    a = str(runs["a"])
    mismatch_figure(audit.mismatch(a, [1]), tmp_path / "one-step-mismatch.png")
    with pytest.raises(routelog.RecordNotFoundError, match="step 1 and no --other run: nothing to compare"):
        audit.drift(a, steps=[1])  # one rule for every audit: nothing to compute is refused (exit 2 on the CLI)


def test_cli_audits(runs: dict[str, object], tmp_path: Path) -> None:
    a, b = str(runs["a"]), str(runs["b"])
    cli = CliRunner()
    for args, key, words in (
        (["stats", a, "--step", "0", "--step", "2"], "layers", "imbalance"),
        (["diff", a, b, "--step", "1"], "router_diff_rate", "router-level diff"),
        (["mismatch", a], "steps", "KL k3"),
        (["drift", a, "--other", b], "consecutive", "mean JS"),
    ):
        plot = tmp_path / f"{args[0]}.png"
        result = cli.invoke(app, [*args, "--json", "--plot", str(plot)])
        assert result.exit_code == 0, result.output
        assert key in json.loads(result.output)
        assert plot.stat().st_size > 10_000
        text = cli.invoke(app, args)
        assert text.exit_code == 0 and words in text.output, text.output
    payload = json.loads(cli.invoke(app, ["stats", a, "--step", "0", "--step", "2", "--json"]).output)
    assert payload["steps"] == [0, 2] and not math.isnan(payload["bytes_per_token_layer"])


def test_routing_differences_count_set_differences() -> None:
    rng = np.random.default_rng(3)
    a = np.argsort(rng.random((200, 4, 12)), -1)[..., :3]
    b = a.copy()
    change = rng.random((200, 4)) < 0.5
    b[change] = np.argsort(rng.random((int(change.sum()), 12)), -1)[:, :3]
    expected = np.array(
        [[len(set(x) - set(y)) for x, y in zip(ra, rb, strict=True)] for ra, rb in zip(a, b, strict=True)]
    )
    assert routing_differences(a, b).tolist() == expected.tolist()
    assert routing_differences(np.sort(a, -1), np.sort(b, -1)).tolist() == expected.tolist()
    assert routing_differences(a[:, :, ::-1], a).max() == 0  # order within a row does not matter


def _rendered(monkeypatch: pytest.MonkeyPatch, draw: object, result: object) -> object:
    """The matplotlib figure ``draw`` builds for ``result``, drawn (not saved)."""
    from routelog.audit import figures

    kept: list[object] = []
    monkeypatch.setattr(figures, "_save", lambda fig, path: kept.append(fig))
    draw(result, Path("unused.png"))  # type: ignore[operator]
    (fig,) = kept
    fig.canvas.draw()  # type: ignore[attr-defined]
    return fig


def _inside(fig: object) -> None:
    """Every title (the figure's and each axes') lies inside the figure at its default size: nothing is cut."""
    width, height = fig.canvas.get_width_height()  # type: ignore[attr-defined]
    texts = [ax.title for ax in fig.axes] + ([fig._suptitle] if fig._suptitle is not None else [])  # type: ignore[attr-defined]
    renderer = fig.canvas.get_renderer()  # type: ignore[attr-defined]
    for text in texts:
        if not text.get_text():
            continue
        box = text.get_window_extent(renderer)
        assert box.x0 >= -1 and box.x1 <= width + 1 and box.y1 <= height + 1, text.get_text()


def test_degenerate_figures_do_not_mislead(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No drift at all, no mismatch at all, and the demo's KL bars: zeros are drawn at 0 on a linear axis from 0
    (no negative ticks, no colour scale forced above the values), bars compare linearly, titles and the largest
    point fit the figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = make_records(12, 0)
    same = str(tmp_path / "same")
    write(same, {0: records, 1: records}, train_noise=0.0)
    drift = audit.drift(same)
    assert all(pair.max_js == 0 for pair in drift.consecutive)
    fig = _rendered(monkeypatch, drift_figure, drift)
    (heat, _bar) = fig.axes  # type: ignore[attr-defined]
    assert heat.images[0].norm.vmin == 0, "the scale starts at no drift"
    assert any("no drift" in t.get_text() for t in heat.texts)
    _inside(fig)

    zero = audit.mismatch(same)
    assert all(s.kl_k3 == 0 and not any(s.extreme.values()) for s in zero.steps)
    fig = _rendered(monkeypatch, mismatch_figure, zero)
    for ax in fig.axes:  # type: ignore[attr-defined]
        low, high = ax.get_ylim()
        assert ax.get_yscale() == "linear" and -0.05 <= low <= 0 < high
        assert all(tick >= 0 for tick in ax.get_yticks() if low <= tick <= high), "no negative ticks"
    _inside(fig)

    other = str(tmp_path / "other")
    write(other, {0: perturb(records, 0.3, 5)})
    result = audit.diff(same, other, step=0)
    fig = _rendered(monkeypatch, diff_figure, result)
    sequences = fig.axes[2]  # type: ignore[attr-defined]
    assert sequences.get_xlim()[1] > max(result.sequence_means), "the largest point is not cut at the edge"
    _inside(fig)

    from routelog.demo_report import _kl_panel

    fig, ax = plt.subplots()
    _kl_panel(ax, {"no_replay": {"kl_k3": 4.2e-4}, "replay": {"kl_k3": 2.0e-4}}, 8.7e-4)
    assert ax.get_yscale() == "linear" and ax.get_ylim()[0] == 0, "bars compare as the values do"
    labels = [t.get_text() for t in ax.texts]
    assert any("0.48x" in label for label in labels), labels
    plt.close(fig)


def test_narrow_and_skewed_figures_do_not_mislead(monkeypatch: pytest.MonkeyPatch) -> None:
    """Values that barely change (a 0.002 % KL change over three steps, runs within 2x) are drawn on a linear axis
    from 0 with their spread in the title, not as a cliff across a log axis; values spanning decades keep a log
    axis; expert load is coloured around uniform (1.0) and imbalance is drawn from 1 = balanced; the demo's dense
    model is labelled a scale, not a floor."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from routelog.audit.drift import DriftPair, DriftResult
    from routelog.audit.load import LayerStats, StatsResult
    from routelog.audit.mismatch import MismatchResult, StepMismatch

    steps = [
        StepMismatch(step=s, records=4, tokens=100, kl_k3=kl, extreme={"1.5": 0.1, "2": 0.05, "5": 0.0})
        for s, kl in enumerate((3.97062e-3, 3.97065e-3, 3.97069e-3))
    ]
    kl_ax, f_ax = _rendered(monkeypatch, mismatch_figure, MismatchResult(url="run", steps=steps)).axes  # type: ignore[attr-defined]
    assert kl_ax.get_yscale() == "linear" and kl_ax.get_ylim()[0] == 0 and kl_ax.get_ylim()[1] > 3.97069e-3
    assert "within 0.0018 %" in kl_ax.get_title(), kl_ax.get_title()
    assert f_ax.get_yscale() == "symlog" and f_ax.get_ylabel().endswith("(log scale)"), "F(t) spans decades and zeros"

    def drift(js: list[float]) -> DriftResult:
        pair = DriftPair(a="run-a step 0", b="run-b step 0", js=js, mean_js=float(np.mean(js)), max_js=max(js))
        return DriftResult(url="run-a", layers=[1, 2, 3], consecutive=[], other_url="run-b", between_runs=[pair])

    (ax,) = _rendered(monkeypatch, drift_figure, drift([0.010, 0.014, 0.019])).axes  # type: ignore[attr-defined]
    assert ax.get_yscale() == "linear" and ax.get_ylim()[0] == 0 and "linear from 0" in ax.get_title()
    (ax,) = _rendered(monkeypatch, drift_figure, drift([1e-4, 1e-3, 0.2])).axes  # type: ignore[attr-defined]
    assert ax.get_yscale() == "log" and ax.get_ylabel() == "Jensen-Shannon divergence (bits) (log scale)"

    def layer(n: int, load: list[int]) -> LayerStats:
        mean = float(np.mean(load))
        return LayerStats(layer=n, load=load, imbalance=max(load) / mean, cv=float(np.std(load)) / mean,
                          entropy_bits=1.0, entropy_normalized=0.5)  # fmt: skip

    layers = [layer(1, [13, 10, 10, 7]), layer(2, [12, 10, 9, 9])]
    stats = StatsResult(url="run", steps=[0], records=4, tokens=40, rows=40, stored_bytes=1, bytes_per_token_layer=1.0,
                        num_experts=4, topk=1, layers=layers)  # fmt: skip
    fig = _rendered(monkeypatch, stats_figure, stats)
    heat, lines = fig.axes[0], fig.axes[1]  # type: ignore[attr-defined]
    norm = heat.images[0].norm
    assert (norm.vmin, norm.vcenter) == (0.0, 1.0) and norm.vmax >= 2.0, "white is uniform load"
    assert lines.get_ylim()[0] == 1.0 and "1 = balanced" in lines.get_ylabel()

    from routelog.demo_report import _kl_panel

    fig, ax = plt.subplots()
    _kl_panel(ax, {"no_replay": {"kl_k3": 4.4e-4}, "replay": {"kl_k3": 1.9e-4}}, 9.0e-4)
    labels = [t.get_text() for t in ax.get_xticklabels()] + [ax.get_title()]
    assert not any("floor" in label for label in labels) and any("for scale" in label for label in labels), labels
    plt.close(fig)


@pytest.mark.parametrize("batch_records", [1, 4, 7, 40])
def test_batches_read_ahead_and_hand_out_every_record_in_order(runs: dict[str, object], batch_records: int) -> None:
    """An audit's batches come from both snapshots, in the order asked, the next read while this one is used;
    a read that fails fails the batch that needed it, and a caller that stops early leaves no reader behind."""
    a = routelog.open_store(str(runs["a"])).step(1)
    b = routelog.open_store(str(runs["b"])).step(1)
    shared = [sid for sid in a.sample_ids if sid in b]
    got = list(batches([a, b], shared, batch_records=batch_records))
    starts = range(0, len(shared), batch_records)
    assert len(got) == len(starts) > 0
    for (left, right), start in zip(got, starts, strict=True):
        ids = shared[start : start + batch_records]
        assert [r.sample_id for r in left] == [r.sample_id for r in right] == ids
        for mine, theirs in zip(left, a.read_many(ids), strict=True):
            np.testing.assert_array_equal(mine.by_layer, theirs.by_layer)
    assert list(batches([a], [], batch_records=batch_records)) == []
    with pytest.raises(KeyError):
        list(batches([a], [*shared[:batch_records], "no-such-record"], batch_records=batch_records))
    early = batches([a, b], shared, batch_records=batch_records)
    next(early)
    early.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("routelog-audit-read")]


class _Meeting:
    """A snapshot whose reads wait, at ``barrier``, for a read of the other snapshot to begin too."""

    def __init__(self, snapshot: routelog.StepSnapshot, barrier: threading.Barrier) -> None:
        self.snapshot, self.barrier = snapshot, barrier

    def read_many(self, sample_ids: list[str]) -> list[object]:
        self.barrier.wait()  # one thread reading both snapshots in turn never gets past this: BrokenBarrierError
        return self.snapshot.read_many(sample_ids)  # type: ignore[return-value]


def test_batches_read_the_two_snapshots_of_a_diff_at_once(runs: dict[str, object]) -> None:
    a = routelog.open_store(str(runs["a"])).step(1)
    b = routelog.open_store(str(runs["b"])).step(1)
    shared = [sid for sid in a.sample_ids if sid in b]
    barrier = threading.Barrier(2, timeout=20)
    got = list(batches([_Meeting(a, barrier), _Meeting(b, barrier)], shared, batch_records=4))  # type: ignore[list-item]
    assert [r.sample_id for left, _ in got for r in left] == shared
    assert [r.sample_id for _, right in got for r in right] == shared
