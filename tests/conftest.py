"""Shared fixtures and helpers for the op tests.

Every op test takes the ``backend`` fixture, parametrized over ``"cpu"`` and ``"gpu"`` (marked
``gpu``; pyproject deselects it by default, the GPU machine runs ``pytest -m gpu``). The fixture
puts computation on that backend (``jax.default_device``) and ``backend.put`` commits inputs there. When
the backend does not exist (no GPU, or ``JAX_PLATFORMS=cpu``) or the CUDA extension is missing, the
first ``backend.put`` / ``backend.device`` in the test body calls ``pytest.fail``: a GPU test that
cannot run FAILS, it never skips.

The oracle is :mod:`jax_kvcm.ops.reference`, always run on the CPU in float32 from the same inputs
(low-precision inputs are upcast exactly), see :func:`reference`.

NOTE: this file does not touch ``JAX_PLATFORMS``; the CPU tests work with it set to ``cpu`` and the
GPU machine runs with it unset.

The tests are grouped like the code (``ops/``, ``manager/``, ``tiers/``, ``arena/``,
``windows/``, ``sharded/``, ``runner/``, ``server/``, ``bench/``, ``kernel_lab/``, ``repo/``).
Test modules import the plain helpers below with ``from conftest import ...`` and each other's
helpers by module name (``from test_manager import Harness``): tests/ and its folders have no
``__init__.py``, so pytest puts tests/ -- never the repo root -- on ``sys.path``, and this file
adds every group folder; the installed ``jax_kvcm`` is the one imported.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import math
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest


# Several xdist workers share one GPU: JAX's default preallocation (75% of the GPU's memory per
# process) leaves the second worker none, and its tests fail with RESOURCE_EXHAUSTED (70 of the
# ops tests at -n 4 on an H100). Each worker allocates on demand instead, unless told otherwise.
# (Read when a backend starts, which is after this.)
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import group_paths
import jax_kvcm
from jax_kvcm import _ffi
from jax_kvcm.ops import reference as _reference

group_paths.add_to_sys_path()

BACKENDS = ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)]

F32, BF16, F16 = jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)
DTYPES = [pytest.param(F32, id="f32"), pytest.param(BF16, id="bf16"), pytest.param(F16, id="f16")]

# Fixed seed list: every randomized test is parametrized over these and prints the seed.
SEEDS = [0, 1, 2]

# (relative L2, max-abs relative to max(1, max|want|)), compared in float32.
TOLERANCES = {F32: (1e-5, 1e-4), BF16: (2e-2, 2e-2), F16: (2e-2, 2e-2)}

NULL_PAGE = 0
# Finite poison in the null page and in the unwritten tail slots of pages in use: a kernel may load
# them (they are in bounds) but must mask them out. Pages no page table references hold NaN: no
# kernel may touch them.
K_POISON, V_POISON = 30.0, -30.0


# ---------------------------------------------------------------------------------------------
# The heap earlier modules left behind.


@pytest.fixture(scope="module", autouse=True)
def _freeze_older_objects():
    """Keeps the garbage collector to the objects this module made.

    By the late modules the objects the earlier ones left (imported modules, jax's caches) number
    over a million, and a full collection traverses them all: ~0.9 s per ``gc.collect()``, which
    the serving benchmark calls after every run (to free a pool before the next one), ~85 s of
    ``tests/bench/test_serve_benchmark.py`` in the whole suite against ~1 s alone. ``gc.freeze()``
    moves them out of the collector's sight for this module (their references still keep this
    module's objects alive; a cycle among this module's objects is still collected). At its end
    (after its module-scoped fixtures) a collection of this module's objects alone frees its
    cyclic garbage (managers and their pools, servers) before the next module freezes what is
    left; ``gc.unfreeze()`` hands the older objects back.
    """
    gc.freeze()
    yield
    gc.collect()
    gc.unfreeze()


# ---------------------------------------------------------------------------------------------
# Backend fixture.


@dataclass
class Backend:
    name: str
    _device: Any
    _error: str | None

    @property
    def device(self):
        if self._device is None:
            pytest.fail(f"backend {self.name!r} cannot run here: {self._error}")
        return self._device

    def put(self, *xs):
        """Commits arrays (numpy or jax) to this backend's device; one value per argument.

        The results own their memory: on CPU, ``jax.device_put`` of an aligned numpy array may
        alias the numpy buffer, and such a buffer cannot be donated (XLA then copies, which would
        make the in-place checks flaky).
        """
        out = tuple(_owned(jax.device_put(x, self.device)) for x in xs)
        return out[0] if len(out) == 1 else out

    @property
    def index_checks_env(self) -> bool:
        """Whether bad indices are reported only under JAX_KVCM_CHECK_INDICES=1 (CUDA handlers)."""
        return self.name == "gpu"


def _owned(x: jax.Array) -> jax.Array:
    """A copy of a device array in memory XLA owns (so it can be donated)."""
    try:
        return jax.device_put(x, x.sharding, may_alias=False)
    except TypeError:  # a jax without may_alias
        return jnp.copy(x)


def _lookup_device(name: str) -> tuple[Any, str | None]:
    try:
        device = jax.devices(name)[0]
    except RuntimeError as e:  # unknown or unavailable backend
        return None, f"jax.devices({name!r}) failed: {e}"
    if name == "gpu" and not jax_kvcm.cuda_extension_available():
        return None, f"jax_kvcm CUDA extension unavailable: {_ffi.CUDA_IMPORT_ERROR}"
    return device, None


@pytest.fixture(params=BACKENDS)
def backend(request) -> Backend:
    device, error = _lookup_device(request.param)
    b = Backend(request.param, device, error)
    if device is None:
        # NOTE: no pytest.fail here: failing in setup reports ERROR; failing in the body reports
        # FAILED, which is what a GPU test that cannot run must do.
        yield b
        return
    with jax.default_device(device):
        yield b


@pytest.fixture
def index_checks(backend, monkeypatch) -> Backend:
    """Bad-index tests: the CUDA handlers report bad indices only with JAX_KVCM_CHECK_INDICES=1.

    Set before the first call (the handler reads it per call); harmless on CPU, which always checks.
    """
    monkeypatch.setenv("JAX_KVCM_CHECK_INDICES", "1")
    return backend


# ---------------------------------------------------------------------------------------------
# Oracle.


@functools.lru_cache(maxsize=None)
def _jitted_reference(name: str, static: tuple[tuple[str, Any], ...]):
    fn = functools.partial(getattr(_reference, name), **dict(static))
    return jax.jit(fn)


def to_f32(x) -> np.ndarray:
    x = np.asarray(x)
    return x.astype(np.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x


def reference(name: str, *args, layer=None, **static) -> Any:
    """Runs ``jax_kvcm.ops.reference.<name>`` on the CPU in float32; returns numpy.

    Float inputs are upcast to float32 (exact); ``layer`` may be an int (traced inside the jit).
    """
    cpu = jax.devices("cpu")[0]
    args = tuple(jax.device_put(to_f32(a), cpu) for a in args)
    fn = _jitted_reference(name, tuple(sorted(static.items())))
    with jax.default_device(cpu):
        if layer is None:
            out = fn(*args)
        else:
            out = fn(*args, layer=jax.device_put(np.int32(layer), cpu))
    return jax.tree.map(np.asarray, out)


# ---------------------------------------------------------------------------------------------
# Comparisons.


def assert_close(got, want, dtype, what: str, seed) -> None:
    """Compares in float32 with relative-L2 and max-abs, with the seed in the message."""
    got, want = to_f32(got), to_f32(want)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape} (seed={seed})"
    bad = ~np.isfinite(got)
    assert not bad.any(), (f"{what}: {int(bad.sum())} non-finite outputs, first at "
                           f"{tuple(int(i) for i in np.argwhere(bad)[0])} (seed={seed})")
    rel_tol, abs_tol = TOLERANCES[jnp.dtype(dtype)]
    err = got - want
    rel = float(np.linalg.norm(err) / max(float(np.linalg.norm(want)), 1e-30))
    max_abs = float(np.abs(err).max()) if err.size else 0.0
    abs_limit = abs_tol * max(1.0, float(np.abs(want).max()) if want.size else 0.0)
    worst = (tuple(int(i) for i in np.unravel_index(np.abs(err).argmax(), err.shape))
             if err.size else ())
    assert rel <= rel_tol and max_abs <= abs_limit, (
        f"{what} ({jnp.dtype(dtype).name}): rel_l2={rel:.3g} (tol {rel_tol:g}), "
        f"max_abs={max_abs:.3g} (tol {abs_limit:.3g}) at {worst} (seed={seed})")


def assert_zero_rows(got, rows, what: str, seed) -> None:
    """Rows (first axis) that must be exactly zero: padded rows read nothing and write zeros."""
    got = to_f32(got)
    rows = np.asarray(rows, dtype=np.int64)
    if rows.size:
        nz = rows[np.any(got[rows].reshape(len(rows), -1) != 0, axis=1)]
        assert nz.size == 0, f"{what}: padded rows {nz.tolist()} are not all zeros (seed={seed})"


def assert_bits_equal(got, want, what: str, seed) -> None:
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape, (
        f"{what}: {got.dtype}{got.shape} != {want.dtype}{want.shape} (seed={seed})")
    g, w = got.view(f"u{got.dtype.itemsize}"), want.view(f"u{want.dtype.itemsize}")
    diff = g != w
    assert not diff.any(), (f"{what}: {int(diff.sum())} elements differ, first at "
                            f"{tuple(int(i) for i in np.argwhere(diff)[0])} (seed={seed})")


# ---------------------------------------------------------------------------------------------
# Random paged batches (numpy, float32; cast with .astype(dtype) before use).


def run_worker(worker: str, *args: str, timeout: float = 600) -> str:
    """Runs the script ``worker`` (beside its test) in a fresh Python, in its folder, without
    the parent's ``XLA_FLAGS`` (the worker sets its own CPU device count); its stdout. Fails
    with the output's tail unless it exits 0 having printed ``OK ``."""
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, worker, *args], env=env, capture_output=True,
                          text=True, timeout=timeout, cwd=os.path.dirname(worker))
    out = proc.stdout + proc.stderr
    name = os.path.basename(worker)
    assert proc.returncode == 0, f"{name} {' '.join(args)} failed:\n{out[-6000:]}"
    assert "OK " in proc.stdout, out[-6000:]
    return proc.stdout


def run_runner(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    """``examples/llama/run.py`` with ``args`` in a fresh Python (output captured)."""
    run = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                       "examples", "llama", "run.py")
    return subprocess.run([sys.executable, run, *args], capture_output=True, text=True,
                          timeout=timeout)


def decode_step_inputs(backend, config, batch: int = 16) -> tuple[Any, Any, tuple]:
    """``(k_cache, v_cache, args)`` on ``backend`` for ``model.decode_step(params, k, v, *args,
    config=config)``: 33 pages of 16 tokens, ``batch`` rows at position 20, two pages each."""
    from examples.llama import model as llama
    kc, vc = backend.put(*llama.make_caches(config, 33, 16))
    B = batch
    args = backend.put(np.zeros(B, np.int32), np.full(B, 20, np.int32),
                       (np.arange(B, dtype=np.int32) * 2 + 2) * 16 + 4,
                       (np.arange(2 * B, dtype=np.int32) + 1).reshape(B, 2),
                       np.full(B, 21, np.int32))
    return kc, vc, args


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def random_page_table(rng: np.random.Generator, seq_lens, page_size: int, max_pages: int,
                      num_pages: int) -> np.ndarray:
    """Distinct random pages >= 1 for the pages each sequence uses; padding entries -> page 0."""
    need = [cdiv(int(n), page_size) for n in seq_lens]
    assert max(need, default=0) <= max_pages and sum(need) <= num_pages - 1, (need, num_pages)
    perm = rng.permutation(np.arange(1, num_pages, dtype=np.int32))
    table = np.full((len(need), max_pages), NULL_PAGE, np.int32)
    used = 0
    for b, n in enumerate(need):
        table[b, :n] = perm[used:used + n]
        used += n
    return table


def token_slots(page_table_row, page_size: int, positions) -> tuple[np.ndarray, np.ndarray]:
    """(page, offset) of the given token positions of one sequence."""
    positions = np.asarray(positions, np.int64)
    return page_table_row[positions // page_size].astype(np.int64), positions % page_size


def make_caches(rng, num_layers: int | None, num_pages: int, page_size: int, num_kv_heads: int,
                head_dim: int, page_table, seq_lens,
                num_written=None) -> tuple[np.ndarray, np.ndarray]:
    """float32 caches holding the first ``num_written[b]`` (default ``seq_lens[b]``) tokens of
    every sequence as random values (in every layer).

    Pages nobody references are NaN; the null page and the other slots of the pages holding
    ``seq_lens[b]`` tokens hold finite poison (K_POISON / V_POISON).
    """
    if num_written is None:
        num_written = seq_lens
    layers = num_layers or 1
    shape = (layers, num_pages, page_size, num_kv_heads, head_dim)
    k = np.full(shape, np.nan, np.float32)
    v = np.full(shape, np.nan, np.float32)
    k[:, NULL_PAGE], v[:, NULL_PAGE] = K_POISON, V_POISON
    for b, (total, n) in enumerate(zip(seq_lens, num_written)):
        n = int(n)
        used = page_table[b, :cdiv(int(total), page_size)]
        k[:, used], v[:, used] = K_POISON, V_POISON
        pages, offs = token_slots(page_table[b], page_size, np.arange(n))
        for l in range(layers):
            k[l, pages, offs] = rng.standard_normal((n, num_kv_heads, head_dim))
            v[l, pages, offs] = rng.standard_normal((n, num_kv_heads, head_dim))
    if num_layers is None:
        k, v = k[0], v[0]
    return k, v


def flat_slots(page_table_row, page_size: int, positions) -> np.ndarray:
    pages, offs = token_slots(page_table_row, page_size, positions)
    return (pages * page_size + offs).astype(np.int32)


# ---------------------------------------------------------------------------------------------
# Compile counting (robust across jax versions: a trace counter plus backend-compile events).


class CompileCounter:
    """Counts XLA backend compilations while active (jax.monitoring duration events)."""

    EVENT = "/jax/core/compile/backend_compile_duration"

    def __init__(self):
        self.count = 0
        self.active = False

    def _listener(self, event, duration, **kwargs):
        if self.active and event == self.EVENT:
            self.count += 1

    @contextlib.contextmanager
    def counting(self):
        self.active = True
        try:
            yield self
        finally:
            self.active = False


@pytest.fixture
def compile_counter():
    counter = CompileCounter()
    jax.monitoring.register_event_duration_secs_listener(counter._listener)
    try:
        yield counter
    finally:
        unregister = (getattr(jax.monitoring, "unregister_event_duration_listener", None)
                      or getattr(jax.monitoring, "_unregister_event_duration_listener_by_callback",
                                 None))
        if unregister is not None:
            unregister(counter._listener)


def random_prompt(rng: np.random.Generator, n: int, vocab: int = 128) -> list[int]:
    """A prompt of n token ids: BOS (1), then ids drawn from [3, vocab)."""
    return [1] + rng.integers(3, vocab, n - 1).tolist()


def shared_prefix_prompts(rng: np.random.Generator, system_lens: tuple[int, int], n: int,
                          suffix: tuple[int, int], alone: int) -> list[list[int]]:
    """``n`` prompts that alternate between two system prompts (:func:`random_prompt` of
    ``system_lens``), each followed by ``[lo, hi)`` random ids (``suffix``), then one prompt of
    ``alone`` tokens that shares nothing."""
    systems = [random_prompt(rng, k) for k in system_lens]
    return ([systems[i % 2] + rng.integers(3, 128, int(rng.integers(*suffix))).tolist()
             for i in range(n)] + [random_prompt(rng, alone)])


def random_hf_llama(kind: str, config_kwargs: dict, seed: int, *, embed_std: float = 1.0,
                    weight_scale: float = 0.6):
    """A float32 HF ``LlamaForCausalLM`` (``kind="llama"``), ``MistralForCausalLM``,
    ``Qwen2ForCausalLM`` or ``Qwen3ForCausalLM`` with eager attention and seeded random weights
    larger than HF's default init (std 0.02 gives near-uniform logits and generations that repeat
    one token, which would make token-for-token checks weak): norms ``1 + 0.1 N(0, 1)``, biases
    ``0.3 N(0, 1)``, embeddings ``embed_std * N(0, 1)``, matrices
    ``weight_scale / sqrt(fan_in) * N(0, 1)``. Needs torch and transformers."""
    import torch
    import transformers

    prefix = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}[kind]
    cfg_cls = getattr(transformers, prefix + "Config")
    model_cls = getattr(transformers, prefix + "ForCausalLM")
    cfg = cfg_cls(**config_kwargs)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(cfg).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
            elif p.ndim == 1:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                std = embed_std if "embed" in name else weight_scale / p.shape[1] ** 0.5
                p.copy_(std * torch.randn(p.shape, generator=gen))
    return model.to(torch.float32)


def hf_checkpoint(hf, directory) -> tuple:
    """``(config, params)`` of the HF model ``hf`` saved as a safetensors checkpoint under
    ``directory`` and loaded back through examples/llama/loader.py in float32 (no tokenizer)."""
    from examples.llama import loader
    hf.save_pretrained(directory, safe_serialization=True)
    config, params, tokenizer = loader.load_checkpoint(directory, dtype="float32", progress=False)
    assert tokenizer is None
    return config, params


# A small Llama (two layers, GQA 2) for serving-loop tests against HF.
SMALL_LLAMA = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                   rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                   rope_theta=10000.0)


def small_llama_checkpoint(directory, seed: int) -> tuple:
    """``(hf, config, params)``: a random :data:`SMALL_LLAMA` through a real checkpoint."""
    hf = random_hf_llama("llama", SMALL_LLAMA, seed)
    return (hf, *hf_checkpoint(hf, directory))


def hf_logits(hf, ids) -> np.ndarray:
    """HF's float32 logits ``[len(ids), vocab]`` of one teacher-forced forward over ``ids``."""
    import torch
    with torch.no_grad():
        return hf(torch.tensor([list(ids)]), use_cache=False).logits[0].float().numpy()


def forget_failed_runtime_tokens() -> None:
    """Drops JAX's runtime tokens after a side-effecting custom call failed on purpose.

    JAX keeps the token of the last side-effecting execution and waits on it at exit; a token
    holding an expected error would print that error again at interpreter exit. Private API, so
    best effort: if it moved, only the exit-time noise comes back.
    """
    try:
        from jax._src import dispatch
        dispatch.runtime_tokens.clear()
    except (ImportError, AttributeError):
        pass


def runtime_error_types() -> tuple[type[BaseException], ...]:
    """What a handler's ffi::Error surfaces as from a jitted call (varies across jax versions)."""
    types: list[type[BaseException]] = [RuntimeError, ValueError]
    for name in ("JaxRuntimeError", "XlaRuntimeError"):
        t = getattr(jax.errors, name, None)
        if isinstance(t, type):
            types.append(t)
    return tuple(types)


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


def visible_gpus() -> int:
    """GPUs jax sees in a fresh process (JAX_PLATFORMS left out), without starting a backend in
    this one; 0 when none or when jax fails there."""
    import os
    import subprocess
    import sys
    code = "import jax; print(len([d for d in jax.devices() if d.platform == 'gpu']))"
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=300)
    return int(proc.stdout.strip() or 0) if proc.returncode == 0 else 0
