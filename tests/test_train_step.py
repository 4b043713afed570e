"""python -m tfcore.train's one step (tfcore.parallel.runner.train_step, on one device as on
a layout's ranks), every DecoderConfig field on the command line, and --mixed-precision."""
from __future__ import annotations

import dataclasses
import json
import zipfile

import numpy as np
import pytest

from tfcore import backend, data, optim
from tfcore import train as train_mod
from tfcore.models.decoder import DecoderConfig, DecoderLM
from tfcore.train import ConfigError, Trainer, TrainConfig

TEXT = TrainConfig(task="shakespeare", seq_len=16, d_model=16, n_layers=1, n_heads=2,
                   steps=6, batch_size=4, lr=2e-2, min_lr=2e-3, warmup_steps=2,
                   dropout=0.1, grad_clip=0.05, dtype="float64", eval_interval=6,
                   eval_batches=1, progress=False)
DIGITS = TrainConfig(task="reverse", n_digits=3, d_model=16, n_layers=1, n_heads=2,
                     steps=6, batch_size=8, lr=1e-2, min_lr=1e-3, warmup_steps=2,
                     weight_decay=0.0, grad_clip=0.0, dtype="float64", eval_interval=6,
                     progress=False)

# TrainConfig's fields before the model's fields were generated (and --mixed-precision):
# what a checkpoint of that version records as its config
OLD_FIELDS = ("task", "text", "n_digits", "seq_len", "standardize", "val_fraction", "d_model",
              "n_layers", "n_heads", "d_ff", "position", "norm", "mlp", "dropout", "dtype",
              "steps", "batch_size", "lr", "min_lr", "warmup_steps", "weight_decay", "beta1",
              "beta2", "eps", "grad_clip", "seed", "out_dir", "eval_interval", "eval_batches",
              "checkpoint_interval", "progress", "dp", "tp", "cp", "zero", "sp",
              "micro_batches", "pp", "virtual", "schedule")


def host(x):
    return np.array(backend.to_numpy(x))


def reference_loop(trainer: Trainer, cfg: TrainConfig):
    """The old Trainer.train_step, written out: zero, forward (dropout keyed by the step),
    backward, clip (or the norm without clipping), the scheduled rate, AdamW (Adam at
    weight decay 0). -> (losses, norms, params)."""
    model = DecoderLM(trainer.model_config).init(cfg.seed)
    params = model.params
    betas = (cfg.beta1, cfg.beta2)
    opt = (optim.AdamW(params, lr=cfg.lr, betas=betas, eps=cfg.eps,
                       weight_decay=cfg.weight_decay) if cfg.weight_decay else
           optim.Adam(params, lr=cfg.lr, betas=betas, eps=cfg.eps))
    batches = (data.TextBatches(trainer.batches.ids, cfg.batch_size, cfg.seq_len, cfg.seed)
               if cfg.task == "shakespeare" else
               data.DigitTask(cfg.n_digits, cfg.task, cfg.batch_size, cfg.seed))
    losses, norms = [], []
    for step in range(cfg.steps):
        x, y = batches.next()
        params.zero_grad()
        rng = (backend.default_rng(train_mod._step_seed(cfg.seed, step, 1))
               if cfg.dropout else None)
        losses.append(float(model.forward(x, y, training=True, rng=rng)[1]))
        model.backward()
        norms.append(optim.clip_grad_norm(params.grad, cfg.grad_clip) if cfg.grad_clip
                     else optim.grad_norm(params.grad))
        opt.lr = optim.warmup_cosine(step, cfg.lr, cfg.warmup_steps, cfg.steps, cfg.min_lr)
        opt.step()
    return losses, norms, host(params.data)


@pytest.mark.parametrize("cfg", [TEXT, DIGITS], ids=["text-dropout-clip", "digits-noclip"])
def test_one_device_is_the_runner_step_and_the_old_loop_bit_for_bit(cfg):
    trainer = Trainer(cfg).run()
    assert trainer.run_state is not None and trainer.run_state.mesh is None   # runner's Run
    losses, norms, params = reference_loop(trainer, cfg)
    assert np.array_equal(np.array(trainer.history["loss"]), np.array(losses))
    assert np.array_equal(np.array(trainer.history["grad_norm"]), np.array(norms))
    assert np.array_equal(host(trainer.params.data), params)
    assert all(n is not None for n in trainer.history["grad_norm"])   # recorded unclipped
    if cfg.grad_clip:
        assert min(norms) > cfg.grad_clip                              # the clip was active


def test_gradient_accumulation_on_one_device_is_the_whole_batch():
    cfg = dataclasses.replace(DIGITS, steps=3)
    whole = Trainer(cfg).run()
    split = Trainer(dataclasses.replace(cfg, micro_batches=4)).run()
    a, b = host(whole.params.data), host(split.params.data)
    assert not np.array_equal(a, b)                         # another order of the sums
    assert np.max(np.abs(a - b)) < 1e-12 * np.max(np.abs(a))
    assert np.allclose(split.history["loss"], whole.history["loss"], rtol=1e-13, atol=0)
    with pytest.raises(ConfigError) as err:                 # the masks would differ
        dataclasses.replace(TEXT, micro_batches=2).validate()
    assert err.value.field == "micro_batches" and "dropout" in str(err.value)


# -- every model field on the command line -----------------------------------------------

def test_every_decoder_field_is_a_config_field_and_a_flag():
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    parser = train_mod._parser()
    flags = {a.dest for a in parser._actions}
    for f in dataclasses.fields(DecoderConfig):
        if f.name in ("vocab_size", "max_seq_len"):        # the data decides them
            continue
        ours = "norm_eps" if f.name == "eps" else f.name
        assert ours in names and ours in flags, f.name


def _run_cli(argv, tmp_path, capsys):
    out = tmp_path / "run"
    code = train_mod.main([*argv, "--out-dir", str(out), "--no-progress"])
    return code, out, capsys.readouterr()


def _model_config(out):
    meta, _ = train_mod.read_checkpoint(out / train_mod.CHECKPOINT_NAME)
    return meta["model_config"], meta["config"]


def test_the_command_line_sets_every_kind_of_model_field(tmp_path, capsys):
    code, out, _ = _run_cli(["--task", "reverse", "--n-digits", "3", "--steps", "2",
                             "--batch-size", "4", "--d-model", "16", "--n-heads", "4",
                             "--n-layers", "2", "--attention", "tiled",
                             "--attention-block-size", "4", "--n-kv-heads", "2",
                             "--recompute", "full", "--no-tied-head", "--no-bias",
                             "--norm-placement", "post", "--gelu-approximate", "none",
                             "--norm-eps", "1e-6", "--init-std", "0.05", "--n-experts", "4",
                             "--top-k", "1", "--moe-every", "2", "--router", "sigmoid",
                             "--capacity-factor", "1.5", "--micro-batches", "2"],
                            tmp_path, capsys)
    assert code == 0
    model, config = _model_config(out)
    expected = dict(attention="tiled", attention_block_size=4, n_kv_heads=2, recompute="full",
                    tied_head=False, bias=False, norm_placement="post",
                    gelu_approximate="none", eps=1e-6, init_std=0.05, n_experts=4, top_k=1,
                    moe_every=2, router="sigmoid", capacity_factor=1.5)
    assert {k: model[k] for k in expected} == expected
    assert config["norm_eps"] == 1e-6 and config["micro_batches"] == 2

    code, out, _ = _run_cli(["--task", "reverse", "--n-digits", "3", "--steps", "1",
                             "--batch-size", "4", "--d-model", "16", "--model-preset",
                             "llama", "--n-layers", "1", "--rope-base", "500"],
                            tmp_path / "llama", capsys)
    model, _ = _model_config(out)
    llama = DecoderConfig.llama(vocab_size=model["vocab_size"], max_seq_len=6, d_model=16,
                                n_layers=1, n_heads=4, rope_base=500.0, dtype="float32")
    assert code == 0 and model == llama.to_dict()


@pytest.mark.parametrize("argv, flag", [
    (["--n-kv-heads", "3"], "--n-kv-heads"),
    (["--norm-eps", "0"], "--norm-eps"),
    (["--n-experts", "2", "--top-k", "3"], "--top-k"),
    (["--recompute", "selective", "--attention", "tiled"], "--recompute"),
    (["--n-experts", "2", "--dp", "2", "--micro-batches", "2"], "--n-experts"),
    (["--task", "autoencoder", "--attention", "tiled"], "--attention"),
    (["--mixed-precision", "fp16", "--dp", "2"], "--mixed-precision"),
    (["--mixed-precision", "bf16", "--dtype", "float64"], "--mixed-precision"),
])
def test_a_bad_model_setting_is_one_line_before_any_work(argv, flag, tmp_path, capsys):
    code, out, cap = _run_cli(["--steps", "2", "--warmup-steps", "0", *argv], tmp_path, capsys)
    lines = cap.err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith(f"error: argument {flag} ")
    assert not out.exists()                                  # nothing was made


def test_a_bad_choice_is_argparses_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        _run_cli(["--attention", "sparse"], tmp_path, capsys)
    err = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and len(err) == 1 and err[0].startswith("error: argument "
                                                                        "--attention")


def _rewrite_meta(path, change):
    """The checkpoint at path with change(meta) applied to its meta entry."""
    with np.load(path, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    meta = json.loads(arrays["meta"].tobytes().decode())
    change(meta)
    arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    train_mod.atomic_write(path, arrays)


def test_a_checkpoint_of_the_previous_version_loads_and_resumes_bit_for_bit(tmp_path):
    """The previous version's checkpoint: its config held OLD_FIELDS only (and no loss
    scaler); its parameters were the one-device run's, which this version's step equals
    bit for bit (the first test). It loads, resumes, and ends where a straight run does."""
    straight = Trainer(TEXT).run()
    half = Trainer(TEXT).run(until=3)
    path = half.save(tmp_path / "checkpoint.npz")

    def old(meta):
        meta["config"] = {k: meta["config"][k] for k in OLD_FIELDS}
        del meta["loss_scaler"]
    _rewrite_meta(path, old)
    with zipfile.ZipFile(path) as zf:
        assert b"norm_eps" not in zf.read("meta.npy")
    resumed = Trainer.from_checkpoint(path).run()
    assert resumed.config == TEXT
    assert np.array_equal(host(resumed.params.data), host(straight.params.data))
    assert resumed.history["loss"] == straight.history["loss"]
    code = train_mod.main(["--resume", str(path), "--no-progress"])   # and the CLI's way
    assert code == 0


# -- mixed precision ----------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["bf16", "fp16"])
def test_mixed_precision_trains_and_resumes_bit_for_bit(mode, tmp_path):
    cfg = dataclasses.replace(TEXT, dtype="float32", dropout=0.0, steps=12, lr=3e-2,
                              eval_interval=12, mixed_precision=mode, grad_clip=1.0)
    straight = Trainer(cfg).run()
    full = Trainer(dataclasses.replace(cfg, mixed_precision=None)).run()
    losses = straight.history["loss"]
    assert np.mean(losses[-3:]) < np.mean(losses[:3]) - 0.3          # it learns
    assert straight.params.data.dtype == np.float32                  # float32 masters
    assert straight.history["loss"] != full.history["loss"]          # the products rounded
    half = Trainer(cfg).run(until=6)
    path = half.save(tmp_path / "checkpoint.npz")
    resumed = Trainer.from_checkpoint(path)
    assert resumed.config.mixed_precision == mode
    resumed.run()
    assert np.array_equal(host(resumed.params.data), host(straight.params.data))
    assert resumed.history == dict(straight.history, tokens_per_s=resumed.history[
        "tokens_per_s"])
    scaler = straight.run_state.scaler
    if mode == "fp16":          # every step is an update or a counted skip
        assert scaler.steps == cfg.steps
        assert straight.optimizer.t + scaler.skipped == cfg.steps
        assert vars(resumed.run_state.scaler) == vars(scaler)
    else:
        assert scaler is None and straight.optimizer.t == cfg.steps


def test_bf16_under_a_simulated_layout_is_one_devices_bf16(tmp_path):
    from tfcore.parallel import SimulatedGroup

    cfg = dataclasses.replace(TEXT, dtype="float32", dropout=0.0, steps=4,
                              eval_interval=4, mixed_precision="bf16", grad_clip=1.0)
    one = Trainer(cfg).run()
    layout = dataclasses.replace(cfg, dp=2, tp=2)
    runs = SimulatedGroup(4).run(lambda world: Trainer(layout, world).run().history["loss"])
    full = Trainer(dataclasses.replace(cfg, mixed_precision=None)).run()
    gap = np.max(np.abs(np.array(runs[0]) - np.array(one.history["loss"])))
    assert gap < 2.0 ** -7 and all(r == runs[0] for r in runs)
    assert one.history["loss"] != full.history["loss"]


def test_an_overflowing_fp16_step_is_skipped_counted_and_resumed(tmp_path):
    cfg = dataclasses.replace(TEXT, dtype="float32", dropout=0.0, steps=4, eval_interval=4,
                              mixed_precision="fp16")
    trainer = Trainer(cfg).run(until=1)
    scaler = trainer.run_state.scaler
    scaler.scale = 2.0 ** 100        # the scaled loss's gradient overflows float16's range
    before = host(trainer.params.data)
    trainer.run(until=2)
    assert scaler.skipped == 1 and scaler.scale == 2.0 ** 99 and trainer.optimizer.t == 1
    assert np.array_equal(host(trainer.params.data), before)        # nothing was stepped
    assert trainer.history["grad_norm"][-1] is None and np.isfinite(trainer.history["loss"][-1])
    resumed = Trainer.from_checkpoint(trainer.save(tmp_path / "checkpoint.npz"))
    assert vars(resumed.run_state.scaler) == vars(scaler)
    trainer.run()
    resumed.run()
    assert np.array_equal(host(resumed.params.data), host(trainer.params.data))
    assert trainer.optimizer.t + scaler.skipped == cfg.steps
