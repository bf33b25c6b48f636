"""The example runner's command line (examples/llama/run.py) and the loader's confinement to the
model directory: arguments checked before the checkpoint loads (one error style, no
tracebacks), --help lists every flag with its default, sizes take units, generations stream as
they complete, a missing 'llama' extra is named. CPU only; each CLI run is a subprocess.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import jax_kvcm  # noqa: F401  (the installed package first; the repo root goes on sys.path after)

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from examples.llama import loader as llama_loader  # noqa: E402
from examples.llama import model as llama  # noqa: E402

RUN = str(ROOT / "examples/llama/run.py")


def cli(*args, timeout=120, code=None):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    cmd = [sys.executable, "-c", code, RUN, *args] if code else [sys.executable, RUN, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=ROOT)


def small_checkpoint(tmp_path, shards=1) -> Path:
    config = llama.LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64,
                               num_hidden_layers=2, num_attention_heads=2,
                               num_key_value_heads=1, head_dim=16, eos_token_ids=(2,),
                               bos_token_id=1)
    return llama_loader.write_random_checkpoint(tmp_path / "m", config, seed=1, shards=shards)


def user_error(r, *words):
    """One style: argparse's usage line and ``run.py: error: ...``, exit status 2, no
    traceback."""
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr and "run.py: error: " in r.stderr, r.stderr[-2000:]
    msg = r.stderr.split("run.py: error: ", 1)[1]
    for w in words:
        assert w in msg, (w, msg)
    assert r.stdout == "", "a user error prints no output (nothing ran)"


@pytest.mark.parametrize("args, words", [
    (["--temperature", "nan"], ["--temperature", "finite"]),
    (["--temperature", "-1"], ["--temperature", ">= 0"]),
    (["--top-p", "0"], ["--top-p"]),
    (["--top-p", "inf"], ["--top-p", "finite"]),
    (["--max-new-tokens", "0"], ["--max-new-tokens"]),
    (["--page-size", "x"], ["--page-size", "integer"]),
    (["--host-bytes", "4 lightyears"], ["--host-bytes", "size"]),
    (["--disk-bytes", "1GiB"], ["--disk-bytes", "--disk-dir"]),
    (["--prompt-ids", "1,a"], ["--prompt-ids"]),
    (["--prompt-ids", "1,-3"], ["--prompt-ids", ">= 0"]),
    (["--prompt-ids", ",".join(["5"] * 600)], ["--max-seq-len"]),
    (["--max-batch", "16", "--max-tokens-per-step", "8"], ["--max-tokens-per-step"]),
    (["--prompt", "hello"], ["--prompt", "tokenizer"]),
    (["--cold-codec", "zip"], ["--cold-codec"]),
    (["--tensor-parallel", "0"], ["--tensor-parallel", ">= 1"]),
    (["--tensor-parallel", "64"], ["--tensor-parallel", "64 devices asked"]),
    (["--static-input-scales", "64"], ["--static-input-scales", "--quantize"]),
    (["--quantize", "fp8", "--static-input-scales", "0"], ["--static-input-scales", ">= 1"]),
    (["--quantize", "fp8", "--static-input-scales", "no/such.txt"],
     ["--static-input-scales", "neither a token count nor a file"]),
])
def test_bad_arguments_fail_before_loading(args, words):
    user_error(cli(*args), *words)


def test_disk_dir_that_is_a_file(tmp_path):
    f = tmp_path / "afile"
    f.write_text("x")
    user_error(cli("--disk-dir", str(f)), "--disk-dir", "not a directory")


def test_model_arguments_checked_before_loading(tmp_path):
    user_error(cli("--model", str(tmp_path / "nope"), "--prompt-ids", "1,2"), "--model")
    user_error(cli("--model", str(tmp_path), "--prompt-ids", "1,2"), "config.json")
    d = small_checkpoint(tmp_path)
    # A bad sampling argument with a real checkpoint: refused before the load (the loader's
    # progress bar never starts), in the same style.
    r = cli("--model", str(d), "--prompt-ids", "1,2", "--temperature", "-0.5")
    user_error(r, "--temperature")
    assert "loading tensors" not in r.stderr
    user_error(cli("--model", str(d), "--prompt", "w1"), "tokenizer.json")
    user_error(cli("--model", str(d)), "--prompt")


def test_help_lists_every_flag_with_its_default():
    r = cli("--help")
    assert r.returncode == 0
    text = " ".join(r.stdout.split())
    flags = ["--model", "--prompt", "--prompt-ids", "--max-new-tokens", "--temperature",
             "--top-p", "--seed", "--json", "--dtype", "--page-size", "--device-pages",
             "--host-bytes", "--disk-dir", "--disk-bytes", "--cold-codec", "--max-batch",
             "--max-tokens-per-step", "--max-seq-len", "--tensor-parallel"]
    options = text.split("options:", 1)[1]
    for i, flag in enumerate(flags):
        start = options.index(f" {flag} ")
        end = min([options.index(f" {f} ", start + 1) for f in flags[i + 1:]
                   if f" {f} " in options[start + 1:]] or [len(options)])
        assert "default" in options[start:end], (flag, options[start:end])


def test_sizes_take_units(tmp_path):
    sys.path.insert(0, str(ROOT / "examples/llama"))
    try:
        import run
    finally:
        sys.path.pop(0)
    assert run.size("4GiB") == 4 << 30 and run.size("512MiB") == 512 << 20
    assert run.size("64K") == 65536 and run.size("1GB") == 10**9 and run.size("123") == 123
    assert run.size("1.5KiB") == 1536
    r = cli("--json", "--prompt-ids", "1,5,9", "--max-new-tokens", "2", "--host-bytes", "1MiB",
            "--disk-dir", str(tmp_path / "new" / "kv"), "--disk-bytes", "2MiB")
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads(r.stdout.splitlines()[-1])["kv_report"]
    assert set(rep["pages"]) == {"device", "host", "disk"}
    assert (tmp_path / "new" / "kv").is_dir()


def test_generations_stream_as_they_complete():
    """The built-in run: the first request's output arrives well before the last one's (the
    runner used to print everything at the end)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    p = subprocess.Popen([sys.executable, RUN, "--json"], stdout=subprocess.PIPE, text=True,
                         env=env, cwd=ROOT, stderr=subprocess.DEVNULL)
    times, lines = [], []
    for line in p.stdout:
        times.append(time.perf_counter())
        lines.append(json.loads(line))
    assert p.wait(timeout=120) == 0
    assert len(lines) == 6 and "kv_report" in lines[-1]
    assert sorted(d["request"] for d in lines[:5]) == [0, 1, 2, 3, 4]
    assert times[-1] - times[0] > 0.2, "all outputs came at once"


BLOCK_EXTRA = """
import runpy, sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("safetensors", "tokenizers"):
            raise ModuleNotFoundError(name)
        return None
sys.meta_path.insert(0, Block())
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_missing_llama_extra_is_named():
    """``pip install .`` alone lacks safetensors: the runner says which extra to install."""
    r = cli(code=BLOCK_EXTRA)
    user_error(r, "safetensors", "tokenizers", "llama", "pip install")


# -- the loader -------------------------------------------------------------------------------


@pytest.mark.parametrize("entry", ["../outside.safetensors", "/abs/x.safetensors",
                                   "sub/x.safetensors", "..", "link.safetensors"])
def test_weight_map_is_confined_to_the_model_directory(tmp_path, entry):
    d = small_checkpoint(tmp_path, shards=2)
    index_file = d / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    shard = sorted(set(index["weight_map"].values()))[0]
    shutil.copy(d / shard, tmp_path / "outside.safetensors")
    (d / "sub").mkdir()
    shutil.copy(d / shard, d / "sub" / "x.safetensors")
    os.symlink(tmp_path / "outside.safetensors", d / "link.safetensors")
    name = next(k for k, v in index["weight_map"].items() if v == shard)
    index["weight_map"][name] = entry
    index_file.write_text(json.dumps(index))
    with pytest.raises(llama_loader.CheckpointError, match="model directory"):
        llama_loader.load_checkpoint(d, progress=False)


def test_weight_map_in_directory_still_loads(tmp_path):
    d = small_checkpoint(tmp_path, shards=2)
    config, params, _ = llama_loader.load_checkpoint(d, progress=False)
    assert config.num_hidden_layers == 2


def test_cascade_flag_keeps_the_generations():
    """``--cascade`` on the built-in run (requests sharing a system prompt): the same generated
    tokens as without, and the report counts what the cascade saved."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    outs = []
    for extra in ([], ["--cascade"]):
        p = subprocess.run([sys.executable, RUN, "--json", *extra], capture_output=True,
                           text=True, env=env, cwd=ROOT, timeout=120)
        assert p.returncode == 0, p.stderr[-2000:]
        outs.append([json.loads(line) for line in p.stdout.splitlines()])
    plain, cascade = outs
    gen = [sorted((d["request"], d["generated_ids"]) for d in o[:-1]) for o in outs]
    assert gen[0] == gen[1] and len(gen[0]) == 5
    assert plain[-1]["kv_report"]["cascade_tokens_saved"] == 0
    assert cascade[-1]["kv_report"]["cascade_tokens_saved"] > 0


def _load(*argv):
    """run.py's argument checks and load_model in this process: ``(config, params, tokenizer)``."""
    from examples.llama import run
    p = run.build_parser()
    args = p.parse_args(list(argv))
    run.check_args(p, args)
    _, config, params, tokenizer, tmp = run.load_model(p, args, progress=False)
    if tmp is not None:
        tmp.cleanup()
    return config, params, tokenizer


def _layer0_qkv_amax(params, config, tokens) -> float:
    """numpy's max|rmsnorm(embed[tokens])| at layer 0 (the q/k/v GEMM's input)."""
    x = np.asarray(params["embed"], np.float64)[tokens]
    normed = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + config.rms_norm_eps)
    return float(np.abs(normed * np.asarray(params["layers"][0]["attn_norm"], np.float64)).max())


def test_static_input_scales_over_random_tokens_and_a_text_file(tmp_path):
    """``--static-input-scales N|FILE`` gives every FP8 linear a static activation scale:
    layer 0's q/k/v scale is max|rmsnorm(x)| / 448 (numpy) over N seeded random tokens, or over
    the file's text through the checkpoint's tokenizer; a text file needs a tokenizer, a bf16
    model needs --quantize; the runner generates with the scales end to end."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from examples.llama import fp8_weights as f8
    n = 24
    config, params, _ = _load("--quantize", "fp8", "--static-input-scales", str(n))
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, n).tolist()
    for lp in params["layers"]:
        assert all(lp[w].input_scale is not None for w in f8.QUANTIZED_WEIGHTS)
    np.testing.assert_allclose(float(params["layers"][0]["wqkv"].input_scale),
                               _layer0_qkv_amax(params, config, tokens) / f8.FP8_MAX, rtol=1e-5)

    d = small_checkpoint(tmp_path)
    text = tmp_path / "calibration.txt"
    text.write_text("w5 w9 w11 w30 w7 w5 w3")
    user_error(cli("--model", str(d), "--prompt-ids", "1,2", "--quantize", "fp8",
                   "--static-input-scales", str(text)), "--static-input-scales", "tokenizer.json")
    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 32)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(d / "tokenizer.json"))
    config, params, _ = _load("--model", str(d), "--prompt-ids", "1,2", "--quantize", "fp8",
                              "--static-input-scales", str(text))
    np.testing.assert_allclose(float(params["layers"][0]["wqkv"].input_scale),
                               _layer0_qkv_amax(params, config, [5, 9, 11, 30, 7, 5, 3])
                               / f8.FP8_MAX, rtol=1e-5)
    user_error(cli("--model", str(d), "--prompt-ids", "1,2", "--static-input-scales", "8"),
               "--static-input-scales", "FP8 weights")
    r = cli("--model", str(d), "--prompt", "w5 w9", "--quantize", "fp8", "--max-new-tokens", "3",
            "--static-input-scales", str(text))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "static activation scales" in r.stdout and "generated (3" in r.stdout, r.stdout
