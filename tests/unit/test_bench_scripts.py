"""Pure logic of the benchmark scripts (no measuring): bench_memory_grid.py's backend fit on a synthetic
grid (scripts/memory_grid), bench_serving.py's comparison over timed passes (bench_serving_stats.py), and
bench_http.py's passes (--repeat) against two stub OpenAI endpoints."""

import argparse
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
# bench_memory_grid.py's parts (scripts/memory_grid)
shapes = pytest.importorskip("memory_grid.shapes")
predict = pytest.importorskip("memory_grid.predict")
backend_fit = pytest.importorskip("memory_grid.backend_fit")
replay = pytest.importorskip("memory_grid.replay")
checks = pytest.importorskip("memory_grid.checks")

SHAPE = dict(H=32, Hkv=8, d=128, D=4096, I=14336, V=128256, L=32, s=2)


def synthetic_grid(tmp_path, paged: bool, copies: bool = True) -> str:
    """Chunks whose transient levels off with the context (0.63 MB per token + 58 MB once n >= 4c, less
    before), and decodes linear in rows and context, like the H200's. `copies`: measured by an engine
    that copies a viewed row's KV for a prompt's last query (False: an older grid's, without)."""
    points = []
    for c in (128, 256, 512, 1024):
        for n in range(c, 8192 + 1, c):
            plateau = 58e6 + 0.63e6 * c
            measured = plateau * min(1.0, 0.4 + 0.6 * n / (4 * c))
            terms = shapes.prefill_terms(SHAPE, c, n, n == 8192)
            terms["prefill_gather"] = 0
            point = dict(kind="prefill", variant="m", c=c, n=n, logits=n == 8192, B=1, gathers=False,
                         measured=0, predicted=0, terms=terms, **({"copies_viewed_kv": True} if copies else {}))
            point["measured"] = int(measured) + shapes.fixed_bytes(SHAPE, point)  # the last query's KV copy
            points.append(point)
    for b in (1, 4, 16):
        for n in (1024, 4096, 8192):
            measured = 1e6 + b * (40 + n / 200) * 1e3 if paged else 1e6 + b * n * 8 * 516 * 5
            points.append(dict(kind="decode", variant="m", B=b, n=n, c=1, logits=True, gathers=not paged,
                               paged=paged, measured=int(measured), predicted=0,
                               terms=shapes.decode_terms(SHAPE, b, n, paged)))
    path = tmp_path / f"grid_{paged}_{copies}.json"
    path.write_text(json.dumps(dict(points=points, shapes={"m": SHAPE})))
    return str(path)


def test_fit_from_above_hugs_each_chunk_sizes_worst_case(tmp_path):
    out = backend_fit.fit_backend(synthetic_grid(tmp_path, paged=True), backend="cuda",
                                  exclude="prefill_scores,prefill_mask", chunk_maxima=True)
    coef = out["coefficients"]
    assert coef["prefill_scores"] == 0 and coef["prefill_mask"] == 0  # excluded
    assert coef["decode_paged"] is not None  # fitted: the grid's decodes were paged
    assert out["predicted_over_measured"]["min"] >= 1.0  # never under, every point included
    data = json.loads(Path(tmp_path / "grid_True_True.json").read_text())
    from engine.core.memory.coefficients import TransientCoefficients
    pts = data["points"]
    pred = predict.engine_predictions(pts, data["shapes"], TransientCoefficients(**coef))
    for c in (128, 256, 512, 1024):
        worst = max(p["measured"] for p in pts if p["kind"] == "prefill" and p["c"] == c)
        predicted = max(pv for pv, p in zip(pred, pts) if p["kind"] == "prefill" and p["c"] == c)
        assert worst <= predicted <= 1.2 * worst, (c, predicted / worst)


def test_a_fit_of_a_grid_measured_without_the_kv_copy_covers_the_copy(tmp_path):
    """An older grid's chunks ending a prompt were measured by an engine that read their viewed KV with no
    copy: the fit must not take the copy out of their measure, or the engine, which now makes it on top
    of the same temporaries, would measure more than the fitted formula predicts."""
    from engine.core.memory.coefficients import TransientCoefficients

    path = synthetic_grid(tmp_path, paged=True, copies=False)
    coef = backend_fit.fit_backend(path, backend="cuda", exclude="prefill_scores,prefill_mask", chunk_maxima=True)
    data = json.loads(Path(path).read_text())
    pts = data["points"]
    pred = predict.engine_predictions(pts, data["shapes"], TransientCoefficients(**coef["coefficients"]))
    ends = [(pv, p) for pv, p in zip(pred, pts) if p["kind"] == "prefill" and p["logits"]]
    assert ends and all(shapes.fixed_bytes(SHAPE, p) == 0 for _, p in ends)
    copy = lambda p: p["n"] * SHAPE["Hkv"] * 2 * SHAPE["d"] * SHAPE["s"]  # noqa: E731
    assert all(pv >= p["measured"] + copy(p) for pv, p in ends)


def test_gathering_grid_leaves_decode_paged_unfitted(tmp_path):
    out = backend_fit.fit_backend(synthetic_grid(tmp_path, paged=False), backend="cuda")
    assert out["coefficients"]["decode_paged"] is None
    assert out["predicted_over_measured"]["min"] >= 1.0


def test_a_fit_holds_its_floors_and_stays_above_the_chunks_it_does_not_fit(tmp_path):
    """--min-terms: coefficients fitted no lower than given (an array the grid cannot separate from others);
    --fit-min-chunk: smaller chunks only bound the fit, which hugs the larger ones more closely. Every
    point stays predicted from above; an unknown coefficient is an error naming it."""
    path = synthetic_grid(tmp_path, paged=True)
    ratio = {}
    for smallest in (0, 512):
        out = backend_fit.fit_backend(path, backend="cuda", exclude="prefill_scores",
                                      floors="prefill_mask=5,decode_paged=2", min_fitted_chunk=smallest)
        assert out["coefficients"]["prefill_mask"] >= 5 and out["coefficients"]["decode_paged"] >= 2
        assert out["predicted_over_measured"]["min"] >= 1.0 and out["min_fitted_chunk"] == smallest
        data = json.loads(Path(path).read_text())
        from engine.core.memory.coefficients import TransientCoefficients
        pred = predict.engine_predictions(data["points"], data["shapes"], TransientCoefficients(**out["coefficients"]))
        large = [pv / p["measured"] for pv, p in zip(pred, data["points"]) if p["kind"] == "prefill" and p["c"] >= 512]
        ratio[smallest] = sum(large) / len(large)
    assert ratio[512] < ratio[0], ratio
    with pytest.raises(ValueError, match="prefill_maks"):
        backend_fit.fit_backend(path, backend="cuda", floors="prefill_maks=5")


def test_merge_reads_grids_kept_under_keys_of_one_file(tmp_path):
    """--merge FILE:KEY,FILE:KEY: the prefill points of both grids and the decode points of the second."""
    grid = dict(json.loads(Path(synthetic_grid(tmp_path, paged=True)).read_text()), environment={})
    both = tmp_path / "runs.json"
    both.write_text(json.dumps({"at_a": {"grid": grid}, "at_b": {"grid": grid}}))
    merged = checks.merge_grids(f"{both}:at_a/grid", f"{both}:at_b/grid")
    kinds = [p["kind"] for p in merged["points"]]
    assert kinds.count("prefill") == 2 * sum(p["kind"] == "prefill" for p in grid["points"])
    assert kinds.count("decode") == sum(p["kind"] == "decode" for p in grid["points"])


def test_largest_per_chunk_keeps_one_prefill_point_per_chunk_size():
    pts = [dict(kind="prefill", variant="v", c=c, n=n, logits=False, gathers=False, measured=m)
           for c, n, m in ((128, 128, 5), (128, 256, 9), (128, 384, 7), (256, 256, 3))]
    pts.append(dict(kind="decode", variant="v", B=1, n=10, measured=1))
    kept = backend_fit.largest_per_chunk(pts, {"v": SHAPE})
    assert sorted((p["kind"], p.get("c"), p["measured"]) for p in kept) == [
        ("decode", None, 1), ("prefill", 128, 9), ("prefill", 256, 3)]


def test_serving_comparison_uses_the_median_of_the_passes():
    stats = pytest.importorskip("bench_serving_stats")
    runs = {}
    for rep, (ours, theirs) in enumerate([(400, 300), (410, 420), (390, 250)]):
        suffix = f"#{rep}" if rep else ""
        runs[f"engine@4{suffix}"] = dict(ttft_mean_s=0.07, output_tok_per_s=ours)
        runs[f"mlx_lm@4{suffix}"] = dict(ttft_mean_s=0.10, output_tok_per_s=theirs)
    out = stats.compare(runs, [4, 8], "engine", "mlx_lm")["4"]
    assert "8" not in stats.compare(runs, [4, 8], "engine", "mlx_lm")  # no run at 8
    assert out["passes"] == 3
    assert out["tok_per_s_ratio"] == pytest.approx(400 / 300)  # median over median, not the first pass
    assert [round(r, 3) for r in out["tok_per_s_ratio_per_pass"]] == [1.333, 0.976, 1.56]
    assert out["ttft_ratio"] == pytest.approx(0.7) and out["engine_ttft_le_mlx_lm"]
    assert out["engine_tok_per_s_ge_1_2x_mlx_lm"]


def test_replay_reproduces_a_recorded_h200_run_before_predicting_it_again():
    """The calibrated H200 run recorded its coefficients: its step plans rebuilt from the JSON (chunks
    read as views, decodes paged) give exactly the predictions it recorded; without views they do not."""
    path = str(Path(__file__).resolve().parents[2] / "scripts/data/h200_s5_prefill_calibrated.json")
    out = replay.replay_prefill(path, "cuda", views=True)
    assert out["recorded_predictions_reproduced"] is True and out["paged_decodes"] is True
    assert out["underpredicted_steps"] == 0 and out["min_step_ratio"] >= 1.0
    with pytest.raises(ValueError, match="do not reproduce"):
        replay.replay_prefill(path, "cuda", views=False)


def test_replay_with_given_coefficients_predicts_with_them():
    """--replay-coefficients: the calibrated run replayed with its own coefficients, passed explicitly
    (the backend's set would differ), gives the predictions it recorded."""
    path = Path(__file__).resolve().parents[2] / "scripts/data/h200_s5_prefill_calibrated.json"
    data = json.loads(path.read_text())
    coefficients = data["ways"]["engine"]["config"]["memory_coefficients"]
    out = replay.replay_prefill(str(path), "cuda", views=True, coefficients=coefficients)
    assert [s["predicted"] for s in out["steps"]] == [s["predicted"] for s in data["ways"]["engine"]["steps"]]
    shipped = replay.replay_prefill(str(path), "cuda", views=True)
    assert shipped["max_predicted_bytes"] != out["max_predicted_bytes"]


def test_replayed_h200_prefill_runs_of_qwen3_and_llama_are_predicted_within_1_2x_never_under():
    """The shipped CUDA calibrations on the recorded H200 prefill runs (views): every Qwen3-8B and Llama-8B
    step of this engine's runs predicted at 1.0-1.2 x its measure (session 7's, whose mixed steps took 3
    decode rows, never under); a step holding the previous step's deferred chunk carries that chunk's
    prediction (never under, its ratio apart). The Qwen3 calibration is what --fit-scale fits from the
    llama's on that run."""
    data = Path(__file__).resolve().parents[2] / "scripts/data"
    runs = [f"{data}/h200_i21_prefill_families.json:qwen3-8b", f"{data}/h200_i21_prefill_families.json:at_c25d549/qwen3-8b",
            f"{data}/h200_s10_a10_prefill.json", f"{data}/h200_s10_b10_prefill.json", f"{data}/h200_s7_prefill_repeat3.json"]
    for run in runs:
        out = replay.replay_prefill(run, "cuda", views=True)
        assert out["underpredicted_steps"] == 0 and out["min_step_ratio"] >= 1.0, run
        assert run == runs[-1] or out["max_uncarried_step_ratio"] <= 1.2, run
    assert [s["carried"] for s in replay.replay_prefill(runs[0], "cuda", views=True)["steps"]] == [False] * 10 + [True]
    fit = json.loads(Path(f"{data}/h200_s7_fit_llama8b.json").read_text().strip().splitlines()[-1])["coefficients"]
    scaled = replay.fit_scale(runs[:2], "cuda", True, fit, ["prefill_mlp", "prefill_hidden"], 1.05)
    from engine.core.memory.coefficients import QWEN3_8B_BF16, SHAPE_CALIBRATIONS

    shipped = SHAPE_CALIBRATIONS[("cuda-ops8", QWEN3_8B_BF16)][1]
    assert (scaled["coefficients"]["prefill_mlp"], scaled["coefficients"]["prefill_hidden"]) == (
        shipped.prefill_mlp, shipped.prefill_hidden)


def test_the_llama_calibration_covers_both_fits_and_todays_decode_grid():
    """The shipped Llama-3-8B calibration's five decode terms are each the larger of its two fits' (so
    its predictions are never below the first fit's, which no recorded H200 run with the q/k rope unfused
    went over), and
    every decode point of the d6d6a06 grid, q/k rope unfused and fused, is predicted at >= 1.0 x its
    measure (the first fit alone: 0.993 x unfused, 0.899 x fused)."""
    import dataclasses

    from memory_grid.predict import engine_predictions

    from engine.core.memory.coefficients import LLAMA3_8B_BF16, SHAPE_CALIBRATIONS

    data = Path(__file__).resolve().parents[2] / "scripts/data"
    shipped = SHAPE_CALIBRATIONS[("cuda-ops8", LLAMA3_8B_BF16)][1]
    fits = [json.loads(Path(f"{data}/{name}").read_text().strip().splitlines()[-1])["coefficients"]
            for name in ("h200_s7_fit_llama8b.json", "h200_i25_fit_llama8b.json")]
    for name in ("decode_scores", "decode_logits", "decode_mlp", "decode_hidden", "decode_paged"):
        assert getattr(shipped, name) == max(f[name] for f in fits), name
    assert shipped.step_overhead_bytes == fits[0]["step_overhead_bytes"]
    first = dataclasses.replace(shipped, **{k: fits[0][k] for k in ("decode_scores", "decode_logits", "decode_mlp",
                                                                      "decode_hidden", "decode_paged")})
    grid = json.loads(Path(f"{data}/h200_i25_grid_decode.json").read_text())
    for key, first_worst in (("plain", 0.99), ("fused_rope", 0.90)):
        points = [p for p in grid[key]["points"] if p["kind"] == "decode"]
        ratios = [a / p["measured"] for a, p in zip(engine_predictions(points, grid[key]["shapes"], shipped), points)]
        assert min(ratios) >= 1.0, key  # (the fused grid even without the fused decode's layers: below)
        old = [a / p["measured"] for a, p in zip(engine_predictions(points, grid[key]["shapes"], first), points)]
        assert min(old) < first_worst + 0.01, key  # what the second fit is for


def test_fused_decodes_count_twice_the_layers_in_flight_and_cover_every_recorded_grid():
    """A decode through the fused q/k rope kernel (and the residual matmul) has fewer operations a layer, so
    more of its layers share MLX's window: the memory model counts FUSED_DECODE_LAYERS_FACTOR times the
    layers in flight for its per-layer terms (within the model's layers; prompt chunks unchanged). Every
    fused decode point of the H200 grids (the 8B llama in two leases with three 2-layer shapes, and in a
    third with the residual matmul too; Qwen3-8B, Gemma-3-12B twice) is then
    predicted from above, the 8B's, Qwen3's and Gemma's at >= 1.3 x; the 8B's later lease was under its
    calibration without it (0.73 x at 4 rows of 1,030 keys: what the factor is for)."""
    import dataclasses

    from memory_grid.checks import decode_check
    from memory_grid.predict import engine_predictions, fused_decodes

    from engine.core.memory.coefficients import LLAMA3_8B_BF16, SHAPE_CALIBRATIONS
    from engine.core.memory.model import FUSED_DECODE_LAYERS_FACTOR, MemoryModel

    data = Path(__file__).resolve().parents[2] / "scripts/data"
    for spec in ("h200_i25_grid_decode.json:fused_rope", "h200_i25_grid_decode.json:variants_fused_rope_at_9d3434c",
                 "h200_i25_grid_decode.json:fused_residual_s28",
                 "h200_i21_decode_families.json:qwen3-8b_fused_rope", "h200_i21_decode_families.json:gemma3-12b_fused_rope",
                 "h200_i21_decode_families.json:gemma3-12b_fused_rope_again_at_0eaa832"):
        for variant, check in decode_check(f"{data}/{spec}").items():
            assert check["fused_decode"] == [True] and check["underpredicted"] == 0, (spec, variant)
            assert check["min"] >= (1.3 if "2layers" not in variant and variant.startswith(("llama", "qwen", "gemma"))
                                    else 1.0), (spec, variant, check["min"])
            assert check["backend_set_min"] >= 1.0, (spec, variant)
    grid = json.loads((data / "h200_i25_grid_decode.json").read_text())["variants_fused_rope_at_9d3434c"]
    assert fused_decodes(grid) and not fused_decodes(json.loads((data / "h200_i25_grid_decode.json").read_text())["plain"])
    points = [p for p in grid["points"] if p["kind"] == "decode" and p["variant"] == "llama-8b"]
    shipped = SHAPE_CALIBRATIONS[("cuda-ops8", LLAMA3_8B_BF16)][1]
    unfactored = engine_predictions(points, grid["shapes"], shipped)
    assert min(a / p["measured"] for a, p in zip(unfactored, points)) < 0.75
    shape = predict.model_shape(grid["shapes"]["llama-8b"])
    plain, fused = (MemoryModel(shape, coefficients=shipped, paged_decode=True, fused_decode=f) for f in (False, True))
    assert fused.decode_layer_factor == min(shape.num_layers, FUSED_DECODE_LAYERS_FACTOR * plain.layer_factor) == 14
    assert fused.decode_bytes([1030] * 4) > plain.decode_bytes([1030] * 4)
    assert fused.prefill_chunk_bytes(512, 1024, True) == plain.prefill_chunk_bytes(512, 1024, True)
    two = dataclasses.replace(shape, num_layers=2)
    assert MemoryModel(two, coefficients=shipped, paged_decode=True, fused_decode=True).decode_layer_factor == 2


def test_the_c25d549_runs_replay_as_their_engine_predicted_them():
    """The Qwen3-8B and Gemma-3-12B (layer loops) H200 runs at c25d549: their plans rebuilt from the JSON
    (each chunk continuing the first prompt it fits, first come first served; views; the copy of a viewed
    row's KV for a prompt's last query; Gemma's sliding layers in rings) give exactly the predictions the
    engine recorded with the coefficients it then shipped (Qwen3's calibration before the c25d549 refit)."""
    import dataclasses

    from engine.core.memory import coefficients as coefs, model as mem

    data = Path(__file__).resolve().parents[2] / "scripts/data/h200_i21_prefill_families.json"
    old_qwen3 = dataclasses.replace(coefs.CUDA_OPS8_COEFFICIENTS, prefill_mlp=1.172, prefill_hidden=4.1,
                                    step_overhead_bytes=1187000, prefill_overhead_bytes=27460000, prefill_layer_rows=136.9)
    for key, coefficients in (("qwen3-8b", old_qwen3), ("gemma3-12b", coefs.CUDA_OPS8_COEFFICIENTS)):
        run = json.loads(data.read_text())["at_c25d549"][key]
        shape, loops = replay.replayed_shape(run)
        assert loops and (key == "qwen3-8b" or shape.num_kv_layers == 8)
        if key == "gemma3-12b":  # Gemma 3's MLP output norm as the engine counted it then (2 rows; now 2.5)
            shape = dataclasses.replace(shape, mlp_out_norm_rows=2.0)
        model = mem.MemoryModel(shape, coefficients=coefficients, paged_decode=True, copies_viewed_kv=True)
        steps = run["ways"]["engine"]["steps"]
        plans = replay.prefill_bench_plans(run, views=True)
        assert [model.step_transient_bytes(p, mixed=s["mixed"]) for p, s in zip(plans, steps)] == [
            s["predicted"] for s in steps]
        assert plans[2].decode_context_lens == (8193, 6145) and plans[1].prefill_chunks[5].computes_logits


def test_the_gemma3_12b_calibration_replays_its_runs_never_under():
    """The Gemma-3-12B calibration (its grids merged, one layer in flight: docs/memory_cuda.md) is the
    engine's for its shape: every point of both H200 grids (prompt chunks read as views and gathered,
    decodes, mixed forwards) and every step of both prefill runs predicted from above, within 1.22 x (the
    step ending the 8192-token prompt: its last query's KV copy, which no measure shows; the mixed step,
    1.21 x since the decode rows' terms cover today's decodes: 1.17 x before); beyond the grids, a chunk grows with the keys as the grids' long chunks did, and a
    fragmented row's gathered chunk KV counts at least one layer's."""
    data = Path(__file__).resolve().parents[2] / "scripts/data/h200_i21_prefill_families.json"
    from engine.core.memory.coefficients import GEMMA3_12B_BF16, SHAPE_CALIBRATIONS, coefficients_for, shape_key
    from engine.core.memory.model import MemoryModel

    for key in ("at_c25d549", "at_3397353"):
        ratios = [s["ratio"] for s in replay.replay_prefill(f"{data}:{key}/gemma3-12b", "cuda", views=True)["steps"]]
        assert min(ratios) >= 1.0 and max(ratios) <= 1.22, (key, ratios)
    grids = {key: json.loads(data.read_text())[key]["gemma3-12b_grid"] for key in ("at_c25d549", "at_d1a5613")}
    shape = predict.model_shape(grids["at_c25d549"]["shapes"]["gemma3-12b"])
    calibrated, what = coefficients_for("cuda", 8, shape, prefill_chunk_size=2048)
    assert shape_key(shape) == GEMMA3_12B_BF16 and calibrated is SHAPE_CALIBRATIONS[("cuda-ops8", GEMMA3_12B_BF16)][1]
    assert "gemma-3-12b" in what and coefficients_for("cuda", 8, shape, prefill_chunk_size=4096)[0] is not calibrated
    for key, grid in grids.items():
        points = [p for p in grid["points"] if p["kind"] in ("prefill", "decode")]
        predicted = predict.engine_predictions(points, grid["shapes"], calibrated)
        assert all(p >= q["measured"] for p, q in zip(predicted, points)), key
    mixed = checks.mixed_check(f"{data}:at_d1a5613/gemma3-12b_grid", calibrated)["gemma3-12b"]
    assert mixed["num_points"] == 8 and mixed["underpredicted"] == 0
    model = MemoryModel(shape, coefficients=calibrated, paged_decode=True)
    # 33 bytes per query and key above the window (a global layer's bf16 scores and mask), to any context
    grows = model.prefill_chunk_bytes(512, 131072, False, gathers=False) - model.prefill_chunk_bytes(512, 8192, False,
                                                                                                  gathers=False)
    assert grows >= 33 * 512 * (131072 - 8192)
    kv_row = shape.num_kv_heads * (2 * shape.head_dim * shape.dtype_bytes + 4)
    for n in (8192, 131072):
        extra = (model.prefill_chunk_bytes(512, n, False, gathers=True)
                 - model.prefill_chunk_bytes(512, n, False, gathers=False))
        assert extra >= (n - shape.sliding_window - 511) * kv_row, n
    # a decode that gathers (paged_attention off: no grid measured one) counts at least the rows' K and V
    # of one layer and their scores, as the set does
    gathering = MemoryModel(shape, coefficients=calibrated, paged_decode=False)
    for rows, n in ((16, 32768), (4, 131072)):
        kv = rows * n * shape.num_kv_heads * 2 * shape.head_dim * shape.dtype_bytes
        assert gathering.decode_bytes([n] * rows, gathers=True) >= kv, (rows, n)
    ratios = [s["ratio"] for s in replay.replay_prefill(f"{data}:at_eb7c392/gemma3-12b", "cuda", views=True)["steps"]]
    assert min(ratios) >= 1.0 and max(ratios) <= 1.2, ratios  # measured with the token-major pool's copy


def test_the_qwen3_and_gemma3_calibrations_cover_todays_decodes():
    """Every decode point of the Qwen3-8B and Gemma-3-12B grids of today's kernels (span kernel,
    token-major pool), q/k rope unfused and fused, and of Gemma 3's grids run again after the refit, is
    predicted from above by the engine's set for the shape (`--check-decodes`); Gemma 3's three per-row
    decode terms are the larger of its two fits' (the first alone under-predicted both grids)."""
    import dataclasses

    from engine.core.memory.coefficients import GEMMA3_12B_BF16, SHAPE_CALIBRATIONS

    data = Path(__file__).resolve().parents[2] / "scripts/data"
    families = data / "h200_i21_decode_families.json"
    grids = json.loads(families.read_text())
    fit = json.loads((data / "h200_i21_fit_gemma3_decodes.json").read_text())["coefficients"]
    shipped = SHAPE_CALIBRATIONS[("cuda-ops8", GEMMA3_12B_BF16)][1]
    rows = ("decode_logits", "decode_mlp", "decode_hidden")
    assert all(getattr(shipped, name) == fit[name] for name in rows)
    first = dataclasses.replace(shipped, decode_logits=9.023, decode_mlp=308.1, decode_hidden=1233.0)
    for key in ("qwen3-8b_plain", "qwen3-8b_fused_rope", "gemma3-12b_plain", "gemma3-12b_fused_rope",
                "gemma3-12b_plain_again_at_0eaa832", "gemma3-12b_fused_rope_again_at_0eaa832"):
        (check,) = checks.decode_check(f"{families}:{key}").values()
        assert check["num_points"] == 27 and check["underpredicted"] == 0 and check["min"] >= 1.0, (key, check)
        assert ("gemma-3-12b" if key.startswith("gemma3") else "qwen3-8b") in check["set"]
        if key.startswith("gemma3") and "again" not in key:  # (a rerun after the refit: a check alone)
            points = [p for p in grids[key]["points"] if p["kind"] == "decode"]
            old = predict.engine_predictions(points, grids[key]["shapes"], first)
            assert min(a / p["measured"] for a, p in zip(old, points)) < 0.9, key  # what the second fit is for


def test_stage_rows_reads_what_a_cpu_grids_stages_hold_per_token():
    """`--stage-rows` on the CPU grid: a llama block's MLP 9 rows a token, its projections 6.4, Gemma's MLP
    two fewer (one MLP-wide array), Qwen3's projections two more (its q/k norms): docs/memory.md's figures."""
    out = checks.stage_rows(str(Path(__file__).resolve().parents[2] / "scripts/data/cpu_i21_grid.json"))
    llama = out["llama-d256"]
    assert all(abs(llama["mlp"][c]["rows"] - 9.0) < 0.1 for c in (64, 128, 256, 512))
    assert all(6.35 <= llama["projections"][c]["rows"] <= 6.5 for c in (64, 128, 256, 512))
    assert all(abs(out["gemma-d256"]["mlp"][c]["less_reference"] + 2.0) < 0.05 for c in (64, 512))
    assert all(abs(out["qwen3-d256"]["projections"][c]["less_reference"] - 2.0) < 0.1 for c in (64, 512))


def test_mixed_forwards_measured_on_the_h200_are_never_under_predicted():
    """The mixed grid of session 7 (scripts/data/h200_s7_grid_mixed*.json: a chunk's forward with 2-32
    decoding rows, 8B llama, its 8-layer cut and three 2-layer shapes): the shipped CUDA set predicts
    every mixed step of the 8- and 32-layer models from above; the 2-layer shapes, where a mixed forward
    measured above the formula, are run apart."""
    from engine.core.memory.coefficients import CUDA_OPS8_COEFFICIENTS

    data = Path(__file__).resolve().parents[2] / "scripts/data"
    deep = checks.mixed_check(str(data / "h200_s7_grid_mixed.json"), CUDA_OPS8_COEFFICIENTS)
    assert deep["llama-8b"]["underpredicted"] == 0 and deep["llama-8b"]["num_points"] == 54
    assert all(isinstance(deep[v], str) for v in ("8b-2layers", "d2048-h16-i8192-v32k", "d4096-h64-i4096"))
    eight = checks.mixed_check(str(data / "h200_s7_grid_mixed_8layers.json"), CUDA_OPS8_COEFFICIENTS)
    assert eight["llama-8b"]["underpredicted"] == 0 and eight["llama-8b"]["min"] >= 1.0


class _StubCompletions:
    """An OpenAI-compatible /v1/completions that streams `max_tokens` one-token chunks (stdlib HTTP in a
    thread): what bench_http's client reads, with every request's prompt recorded under the stub's name."""

    def __init__(self, name: str, seen: list):
        import http.server
        import threading

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_GET(self):
                body = json.dumps({"data": [{"id": name}]}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self):
                req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                seen.append((name, req["prompt"]))
                events = [{"choices": [{"text": "x"}]} for _ in range(req["max_tokens"])]
                events.append({"choices": [], "usage": {"completion_tokens": req["max_tokens"]}})
                payload = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
                body = payload.encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self):
        self.httpd.shutdown()


def test_http_repeat_alternates_the_servers_and_gives_each_pass_its_own_prompts(tmp_path, monkeypatch):
    pytest.importorskip("httpx")
    bench_http = pytest.importorskip("bench_http")
    serving = pytest.importorskip("bench_serving")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")  # no tokenizer: prompts are counted in words
    seen = []
    ours, theirs = _StubCompletions("ours", seen), _StubCompletions("theirs", seen)
    started = []

    class Started:
        def stop(self):
            started.append("stop")

    def fake_mlx_lm(args, folder):
        started.append("start")
        return Started()

    monkeypatch.setattr(bench_http, "start_mlx_lm", fake_mlx_lm)
    try:
        args = serving.parse_args(["--url", ours.url, "--compare-mlx-lm", "--mlx-lm-port", str(theirs.port),
                                   "--model", str(tmp_path / "model"), "--concurrency", "2",
                                   "--prompt-tokens", "8", "--output-tokens", "3", "--num-requests", "2",
                                   "--repeat", "3", "--log-dir", str(tmp_path / "logs")])
        result = bench_http.http_mode(args)
    finally:
        ours.stop()
        theirs.stop()
    assert started == ["start", "stop"] * 3  # mlx_lm.server started afresh for every pass
    # passes alternate which server goes first: ours, theirs | theirs, ours | ours, theirs
    order = [name for name, _ in seen]
    firsts = [order[i] for i in range(0, len(order), len(order) // 6)]  # 4 requests (2 warm-up) a server a pass
    assert firsts == ["ours", "theirs", "theirs", "ours", "ours", "theirs"]
    for name in ("ours", "theirs"):
        prompts = [p for n, p in seen if n == name]
        assert len(prompts) == 12 and len(set(prompts)) == 12  # no pass repeats a prompt (prefix cache)
    assert set(result["targets"]["mlx_serve"]["runs"]) == {"2", "2#1", "2#2"}
    assert set(result["targets"]["mlx_lm_server"]["runs"]) == {"2", "2#1", "2#2"}
    comparison = result["comparison"]["2"]
    assert comparison["passes"] == 3 and len(comparison["tok_per_s_ratio_per_pass"]) == 3
    for run in result["targets"]["mlx_serve"]["runs"].values():
        assert run["num_ok"] == 2 and run["output_tokens"] == 6


def test_a_server_is_not_started_on_a_port_still_in_use():
    import socket

    bench_http = pytest.importorskip("bench_http")
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        with pytest.raises(RuntimeError, match=f"port {port} is still in use"):
            bench_http.wait_port_free(port, 0.3)
    bench_http.wait_port_free(port, 0.3)  # closed: returns at once


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
def test_stopping_a_server_waits_for_what_it_started_in_other_sessions(tmp_path):
    """As `serve run`: the server's leader exits at once on SIGINT; a child in its group (the raylet)
    takes 2 s to shut down; that child's child runs in a session of its own (a Ray worker, the proxy
    holding the HTTP port among them) and ignores SIGINT. Stopping must not return while it lives."""
    import socket
    import time

    bench_http = pytest.importorskip("bench_http")
    pid_file = tmp_path / "worker.pid"
    (tmp_path / "worker.py").write_text(
        "import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\ntime.sleep(600)\n")
    (tmp_path / "raylet.py").write_text(
        "import subprocess, sys, time\n"
        f"p = subprocess.Popen([sys.executable, {str(tmp_path / 'worker.py')!r}], start_new_session=True)\n"
        f"open({str(pid_file)!r}, 'w').write(str(p.pid))\n"
        "try:\n    time.sleep(600)\nexcept KeyboardInterrupt:\n    time.sleep(2)\n")
    leader = (f"import subprocess, sys, time\nsubprocess.Popen([sys.executable, {str(tmp_path / 'raylet.py')!r}])\n"
              "time.sleep(600)\n")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # free once closed
    server = bench_http.Server([sys.executable, "-c", leader], str(tmp_path / "log"), port)
    deadline = time.monotonic() + 10
    while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    pid = int(pid_file.read_text())
    worker = {pid: bench_http.read_stat(pid)[1][19]}  # pid -> start time
    assert set(worker) <= set(bench_http.descendants(server.proc.pid))
    server.stop(grace_s=3.0)  # the worker ignores SIGINT: killed after the grace
    assert not bench_http.alive(worker)


def test_constrained_cost_is_the_mixed_over_the_free_median():
    constrained = pytest.importorskip("bench_constrained")
    passes = {"free": [{"t": 1.0}, {"t": 2.0}, {"t": 9.0}], "mixed": [{"t": 3.0}, {"t": 2.5}, {"t": 0.1}]}
    result = {}
    assert constrained._median_cost(result, passes, "t", "t_median", "t_cost") == {"free": 2.0, "mixed": 2.5}
    assert result == {"t_median": {"free": 2.0, "mixed": 2.5}, "t_cost": 0.25}


def test_long_span_attention_fills_the_device_and_takes_head_sizes_a_warp_splits():
    """The long-span decode kernel's span (engine/model/kernels/split_attention.py): the longest power of
    two from 64 to 1024 keys that still gives about four thread blocks per multiprocessor; head sizes whose
    rows split into 16-byte loads over a divisor of a warp's lanes."""
    from engine.model.kernels.split_attention import span_keys, supports

    assert span_keys(64, 8, 768) == 512  # 64 rows x 8 KV heads x 2 spans = 1024 blocks >= 4 x 132
    assert span_keys(128, 8, 768) == 1024
    assert span_keys(16, 8, 768) == 128
    assert span_keys(1, 8, 256) == 64  # a lone short row: the shortest span
    for rows, heads, length in ((64, 8, 768), (16, 8, 768), (8, 8, 2304)):
        keys = span_keys(rows, heads, length)
        assert rows * heads * -(-length // keys) >= 4 * 132 or keys == 64
        assert keys == 1024 or rows * heads * -(-length // (2 * keys)) < 4 * 132
    assert [supports(d) for d in (64, 96, 128, 256, 80)] == [True, False, True, True, False]


def test_tiled_attention_takes_only_shapes_its_shared_memory_and_rounds_allow():
    """The tiled decode kernel (split_attention.TILED_PARTIAL) holds two K and two V tiles of 4096
    2-byte elements and every warp's running max and sum per query head of a group in static shared
    memory (48 KB at most); the warps' accumulators for the final merge reuse the key tiles, so they must
    fit there: Llama-3-8B's groups of 4 and Qwen3-30B-A3B's of 8 at D = 128, Gemma-3-12B's of 2 at
    D = 256 take it, groups of 16 at D = 128 (or of 8 at D = 256) take the span kernel; 4-byte elements
    and thread counts whose warps do not split a tile into whole rounds never take it."""
    from engine.model.kernels.split_attention import STATIC_SHARED_BYTES, tiled_shared_bytes, tiled_supports

    assert tiled_shared_bytes(128, 4, 128) == 32896 and tiled_shared_bytes(256, 2, 128) == 32832
    assert [tiled_supports(128, 2, n) for n in (1, 2, 4, 8, 16)] == [True, True, True, True, False]
    assert [tiled_supports(256, 2, n) for n in (1, 2, 4, 8)] == [True, True, True, False]
    assert tiled_supports(64, 2, 16) and not tiled_supports(64, 2, 32)
    assert tiled_supports(128, 2, 4, threads=256) and not tiled_supports(128, 2, 8, threads=256)
    assert not tiled_supports(128, 4, 4) and not tiled_supports(96, 2, 4)
    assert not tiled_supports(128, 2, 4, threads=1024) and not tiled_supports(128, 2, 4, threads=96)
    for d, n in ((64, 16), (128, 8), (256, 4)):
        assert tiled_shared_bytes(d, n, 128) <= STATIC_SHARED_BYTES


def test_the_tight_burst_replay_reproduces_the_h200_runs_chunk_shapes():
    """bench_tight_burst.py --replay (the Scheduler alone, the 8B's CUDA memory model) gives the padded
    H200 burst at 3 GB step for step as the engine ran it (h200_i24_tight_burst.json, its steps, forwards,
    chunk shapes and padded chunks; its step budget then, 8192), so its counts for other granules stand for what the engine would do."""
    import bench_tight_burst

    data = Path(__file__).resolve().parents[2] / "scripts/data/h200_i24_tight_burst.json"
    recorded = json.loads(data.read_text())["pad_last_chunk_on_at_c25d549"]
    run = recorded["engine"]["3000000000"]
    result = bench_tight_burst.main([
        "--replay", "--model", "llama-8b", "--dtype", "bfloat16", "--headroom-gb", "3", "--max-num-seqs", "64",
        "--max-model-len", "8448", "--granules", "128", "--pad-last-chunk", "on", "--budgets", "8192",
        "--weights-bytes", str(recorded["weights_bytes"])])
    got = result["variants"]["granule_128_pad_on"]["3000000000"]
    for key in ("num_steps", "num_memory_limited_steps", "num_forwards", "num_chunks", "num_chunk_shapes",
                "num_new_chunk_shapes", "num_padded_chunks", "num_pad_tokens"):
        assert got[key] == run[key], key


def test_step_timings_split_a_recorded_runs_time_by_what_ran():
    """bench_tight_burst.py --timings: decode steps (the first of each row count, synchronous or pipelined,
    apart) and prompt-chunk forwards on and off the grid, at their shape's first forward and repeated."""
    from tight_burst_replay import step_timings

    def step(decodes, shapes=(), forwards=(), duration=0.01, pipelined=False):
        return dict(decodes=decodes, chunk_shapes=[list(s) for s in shapes], forwards=[list(f) for f in forwards],
                    duration_s=duration, pipelined=pipelined)

    steps = [step(2, duration=1.5), step(2), step(2, duration=0.02, pipelined=True),
             step(1, [(128, 256, 1, 0), (100, 356, 1, 0)], [(0.0, 0.05), (0.05, 0.13)]),
             step(1, [(128, 256, 1, 0)], [(0.0, 0.01)]), step(0, [(128, 384, 1, 0)], [(0.0, None)])]
    t = step_timings(steps)
    assert t["decode_steps"] == 3 and t["decode_s"] == 1.53
    assert t["first_decode_of_row_count_s"] == {"2": 1.5, "2 pipelined": 0.02}
    assert t["chunk_forwards"]["on_grid"] == dict(num=2, first_median_ms=50.0, repeated_median_ms=10.0, total_s=0.06)
    assert t["chunk_forwards"]["off_grid"] == dict(num=1, first_median_ms=80.0, repeated_median_ms=None, total_s=0.08)
    # the committed run the docs quote (docs/tight_burst.md)
    import bench_tight_burst

    data = Path(__file__).resolve().parents[2] / "scripts/data/h200_i24_tight_burst.json"
    run = bench_tight_burst.main_timings(argparse.Namespace(
        timings=f"{data}:warmup_1024_cache_at_ca213c1", json=False, out=None))["3000000000"]
    assert run["first_decode_of_row_count_s"]["4 pipelined"] == 3.407 and run["decode_s"] == 18.33


def test_the_cpu_loops_set_and_the_tiny_calibration_are_their_fits_and_bound_the_steps():
    """The CPU layer loops' set and the tiny model's calibration are the LP fits recorded in
    scripts/data/cpu_i21_fit.json (the tiny one's prefill terms; its decode terms the set's), and a second
    recording of the engine tests' steps (scripts/data/cpu_i21_steps.json) is predicted from above, every
    family's step (mixed forwards too) within 1.2 x but a kept-quantized model's through mlx-lm's modules
    (not checked here), the tiny model's (hidden 64, 24 KB a forward) within 1.25 x; the 2-layer
    llama shapes' from above."""
    import dataclasses

    from engine.core.memory.coefficients import CPU_COEFFICIENTS, SHAPE_CALIBRATIONS, TINY_F32

    data = Path(__file__).resolve().parents[2] / "scripts/data"
    fits = json.loads((data / "cpu_i21_fit.json").read_text())
    fields = {f.name for f in dataclasses.fields(CPU_COEFFICIENTS)}
    assert all(getattr(CPU_COEFFICIENTS, k) == v for k, v in fits["cpu"]["coefficients"].items() if k in fields)
    tiny = SHAPE_CALIBRATIONS[("cpu", TINY_F32)][1]
    for k, v in fits["tiny"]["coefficients"].items():
        if k in fields:
            assert getattr(tiny, k) == (getattr(CPU_COEFFICIENTS, k) if k.startswith("decode_") else v), k
    steps = json.loads((data / "cpu_i21_steps.json").read_text())
    shapes = steps["shapes"]
    for p in steps["points"]:
        if p["kind"] != "step" or p["path"] != "loops":
            continue
        ratio = checks.step_prediction(p, shapes, _engine_set(shapes, p["variant"])) / p["measured"]
        family = p["variant"].endswith("-d256") and not p["variant"].startswith("d256")
        bound = 1.25 if p["variant"] == "tiny" else 1.2  # tiny: 24 KB a forward
        assert 1.0 <= ratio and (ratio <= bound or not family and p["variant"] != "tiny"), (p["variant"], ratio)


def _engine_set(shapes: dict, variant: str):
    from engine.core.memory.coefficients import coefficients_for

    return coefficients_for("cpu", None, predict.model_shape(shapes[variant]))[0]


def test_lp_fit_bounds_every_point_from_above_and_trims_the_excess():
    """lp_fit: every row a @ x >= b, and with `hi` stages the least excess over the bound first."""
    import numpy as np

    from memory_grid.lp import lp_fit

    rng = np.random.default_rng(0)
    a = rng.uniform(1, 10, size=(40, 3))
    truth = np.array([2.0, 1.0, 0.5])
    measured = a @ truth
    x, worst = lp_fit(a, measured, measured, np.zeros(3), np.ones(40))
    assert worst is None and np.all(a @ x >= measured * (1 - 1e-9))
    assert np.max((a @ x) / measured) < 1.01  # the formula holds exactly: the fit finds it
    x, worst = lp_fit(a, measured, measured, np.zeros(3), np.ones(40), hi=a[:5], hi_fixed=np.zeros(5),
                      hi_measured=measured[:5], hi_step=list(range(5)))
    assert worst is not None and worst < 1e-6 and np.all(a @ x >= measured * (1 - 1e-9))


def test_a_grid_shape_s_matmul_workspace_is_in_its_predictions_and_out_of_the_fit():
    """A decode grid point of a shape whose engine measured its matmuls' workspaces (`decode_grid`
    records them as the shape's `matmul_workspace`): the engine's prediction counts them (every layer's
    and the head's), and a fit row takes them out of the measure (a decode's fixed bytes), so a refit does
    not count them again; a shape without them (older grids, the CPU) predicts as before."""
    from engine.core.memory.coefficients import CUDA_OPS8_COEFFICIENTS

    config = dict(model_type="llama", hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=512, vocab_size=1000, rms_norm_eps=1e-5)
    plain = shapes.shape_of(config, 2)
    measured = dict(plain, matmul_workspace={"per_layer": [1000, 3000, 2000], "head": [10, 20, 30]})
    point = dict(kind="decode", variant="v", B=3, n=300, c=1, logits=True, gathers=False, paged=True,
                 measured=10 ** 7)
    coef = CUDA_OPS8_COEFFICIENTS
    before = predict.engine_predictions([point], {"v": plain}, coef)[0]
    after = predict.engine_predictions([point], {"v": measured}, coef)[0]
    assert after - before == 2 * 3000 + 30  # two layers' (the most at 3 rows or fewer) and the head's
    names = ["decode_mlp"]
    _, fitted_plain = backend_fit._fit_row(point, {"v": plain}, coef, names)
    _, fitted = backend_fit._fit_row(point, {"v": measured}, coef, names)
    assert fitted_plain - fitted == 2 * 3000 + 30


def test_decode_gemm_plans_fit_its_kernel_and_fill_the_card():
    """scripts/bench_decode_gemm.py's plan (the candidate decode GEMM, GPU only): for the 8B's decode
    products at 1-128 rows the fragments cover the rows, the K split divides K into whole steps, each
    warp's features divide N, and the grid gives the card a block a multiprocessor with no more K splits
    than that needs; the two outputs' sources differ only in their write."""
    import bench_decode_gemm as dg

    for n, k in dg.SHAPES.values():
        for m in (1, 4, 16, 64, 128):
            p = dg.DecodeGemm.plan(m, n, k)
            assert p["NT"] * 8 >= m > (p["NT"] - 1) * 8 and p["MT"] * p["NT"] <= 16
            assert k % (32 * p["U"] * p["SPLIT"]) == 0 and n % (16 * p["MT"]) == 0
            assert p["blocks"] * dg.WARPS * 16 * p["MT"] >= n
            assert p["blocks"] * p["SPLIT"] >= dg.FILL or p["SPLIT"] == 16 or k % (64 * p["U"] * p["SPLIT"])
            assert p["SPLIT"] == 1 or p["blocks"] * p["SPLIT"] // 2 < dg.FILL  # no more splits than needed
    assert dg.DecodeGemm.plan(64, 4096, 4096)["SPLIT"] > 1 and dg.DecodeGemm.plan(64, 128256, 4096)["SPLIT"] == 1
    assert "WRITE" not in dg.GEMM_OUT + dg.GEMM_PART
    assert dg.GEMM_OUT.replace("out[(size_t)tok * N + f] = static_cast<T>(acc[mt][nt][i])", "W") == \
        dg.GEMM_PART.replace("part[((size_t)blockIdx.y * M + tok) * N + f] = acc[mt][nt][i]", "W")


def test_decode_lookup_variants_read_the_same_rows(tmp_path):
    """scripts/bench_decode_small_ops.py on the CPU with a small table: every lookup variant (the
    engine's index, take of the flat ids, ids the host writes at each call) gives the reference rows
    (the script raises where one differs) and a time for each row count; the copy kernel is CUDA's only."""
    import bench_decode_small_ops as small

    out = tmp_path / "small.json"
    result = small.main(["--rows", "1,5", "--calls", "4", "--vocab", "512", "--json", "--out", str(out)])
    assert set(result["us_per_call"]) == {"rows_1", "rows_5"}
    for case in result["us_per_call"].values():
        assert {"index_2d", "take_flat", "index_2d_host_ids"} <= set(case)
        assert all(v > 0 for v in case.values())
    assert json.loads(out.read_text())["table"] == [512, small.HIDDEN]
    w = small.mx.arange(3 * small.HIDDEN, dtype=small.mx.float32).reshape(3, small.HIDDEN)
    ids = small.mx.array([2, 0], small.mx.uint32)
    for name, fn in small.VARIANTS.items():
        if name != "copy_kernel":
            assert fn(w, ids, [2, 0]).shape == (2, 1, small.HIDDEN)
            assert fn(w, ids, [2, 0])[0, 0, 0].item() == 2 * small.HIDDEN


def test_an_ncu_log_is_summed_by_kind_and_a_steps_matmul_rate_read_from_it(tmp_path):
    """scripts/profile_decode.py --ncu-csv on a small log in Nsight Compute's CSV form: kernels summed by
    kind (times in their units), and with --prompt-tokens-in-step the matmuls' TFLOP/s of those tokens."""
    import profile_decode
    from bench_common import RANDOM_SHAPES, matmul_params

    rows = [("nvjet_sm90_tst_256x64", "msecond", "2"), ("nvjet_sm90_tst_96x64", "usecond", "500"),
            ("void mlx::rope<bf16>", "nsecond", "4,000"), ("void mlx::gather<bf16>", "usecond", "5")]
    head = '"ID","Kernel Name","Metric Name","Metric Unit","Metric Value"'
    body = [f'"{i}","{n}","gpu__time_duration.sum","{u}","{v}"' for i, (n, u, v) in enumerate(rows)]
    log = tmp_path / "ncu.csv"
    log.write_text("==PROF== noise\n" + "\n".join([head] + body) + "\n")
    result = profile_decode.main(["--ncu-csv", str(log), "--prompt-tokens-in-step", "1000", "--model", "llama-8b"])
    assert result["num_kernels"] == 4 and result["total_gpu_ms"] == 2.509
    assert result["kinds"]["gemm"] == {"count": 2, "ms": 2.5}
    assert result["kinds"]["rope"]["ms"] == 0.004 and result["kinds"]["copy"]["ms"] == 0.005
    want = 2 * matmul_params(RANDOM_SHAPES["llama-8b"]) * 1000 / 2.5e-3 / 1e12
    assert result["gemm_tflops"]["tflops"] == round(want, 1)


def test_trace_summary_takes_the_pipelined_decode_steps():
    """bench_serving --trace-summary: only traced steps whose decode a launch thread encoded count."""
    from bench_serving_stats import trace_summary

    trace = [{"schedule": 20.0, "step": 400.0}, {"prev_encoded_at": 6.0, "step": 7.0},
             {"prev_encoded_at": 5.0, "step": 9.0}, {"prev_encoded_at": 5.5, "step": 8.0}]
    out = trace_summary({"runs": {"engine@64": {"step_trace_ms": trace}, "mlx_lm@64": {}}})
    assert out == {"engine@64": {"pipelined_steps": 3, "median_step_ms": 8.0},
                   "mlx_lm@64": {"pipelined_steps": 0, "median_step_ms": None}}
