"""One params pytree everywhere, one backend seam: ``load`` gives the checkpoint's layout on every platform
(differentiable, editable), the backend is chosen once, its execution form is derived and kept, and
runtime choices never reach a saved config."""

import json
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cpu_kernels
import llm_jax
from llm_jax import backends
from llm_jax.backends import BackendError, CpuKernels, Pallas, Xla
from llm_jax.model import param_shapes
from llm_jax.weights.checkpoint import load_checkpoint, save_checkpoint
from llm_jax.weights.convert import convert
from llm_jax.weights.placement import leaves_by_path
from multi_device import PYTHON, REPO, cpu_devices_env

needs_kernels = pytest.mark.skipif(not cpu_kernels.available(), reason="the CPU kernels did not build here")
PROMPT = "Once upon a time there was a little dog who"


def _layout(params) -> dict[str, list]:
    return {"/".join(path): [list(x.shape), jnp.dtype(x.dtype).name] for path, x in leaves_by_path(params).items()}


def _next_token_loss(model: llm_jax.Model):
    tokens = jnp.asarray([model.tokenizer.encode(PROMPT)])

    def loss(params):
        logits = llm_jax.forward(params, model.config, tokens[:, :-1], backend=model.backend)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], axis=-1))

    return loss


def test_backend_choice():
    assert backends.choose("xla") == Xla() and backends.choose("pallas") == Pallas()
    assert backends.choose(Xla()) == Xla()
    if cpu_kernels.available():
        assert backends.choose("auto") == CpuKernels() == backends.choose("cpu")
    mesh = llm_jax.make_mesh("data=1,model=1")
    assert backends.choose("auto", mesh=mesh) == Xla()
    with pytest.raises(BackendError, match="the cpu backend runs on one device .* use 'xla'"):
        backends.choose("cpu", mesh=mesh)
    with pytest.raises(BackendError, match="unknown backend 'tpu'; choose one of 'auto', 'xla', 'cpu', 'pallas'"):
        backends.choose("tpu")


@needs_kernels
def test_load_gives_the_canonical_params_and_the_backend_its_own_form(stories260k_dir):
    model = llm_jax.load(stories260k_dir / "hf")
    assert model.backend == CpuKernels()
    assert _layout(model.params) == _layout(param_shapes(model.config))
    assert all(jnp.issubdtype(x.dtype, jnp.floating) for x in jax.tree.leaves(model.params))
    weights = model.weights
    assert weights is model.weights  # derived once, kept with the model
    assert "greedy_screen" in weights and "greedy_screen" not in model.params
    assert llm_jax.load(stories260k_dir / "hf", backend="xla").weights.keys() == model.params.keys()


@needs_kernels
def test_grad_over_loaded_params_is_the_xla_gradient(stories260k_dir):
    """jax.grad of a next-token loss over ``load(...).params`` on CPU (the kernels' products and attention,
    with XLA's gradients) is finite and equals the gradient with the kernels off, ≤ 1e-5."""
    kernels = llm_jax.load(stories260k_dir / "hf")
    xla = llm_jax.load(stories260k_dir / "hf", backend="xla")
    assert kernels.backend == CpuKernels() and xla.backend == Xla()
    ours = jax.jit(jax.grad(_next_token_loss(kernels)))(kernels.params)
    theirs = jax.jit(jax.grad(_next_token_loss(xla)))(xla.params)
    assert jax.tree.structure(ours) == jax.tree.structure(kernels.params)
    largest = 0.0
    for path, g in leaves_by_path(ours).items():
        g, expected = np.asarray(g), np.asarray(leaves_by_path(theirs)[path])
        assert np.isfinite(g).all(), path
        np.testing.assert_allclose(g, expected, atol=1e-5, rtol=0, err_msg="/".join(path))
        largest = max(largest, float(np.abs(expected).max()))
    assert largest > 1e-3  # a gradient that is not everywhere zero


def test_editing_a_weight_changes_the_output(stories260k_dir):
    model = llm_jax.load(stories260k_dir / "hf")
    tokens = jnp.asarray([model.tokenizer.encode(PROMPT)])
    before = llm_jax.forward(model.params, model.config, tokens, backend=model.backend)
    q_proj = model.params["layers"]["attn"]["q_proj"]  # [L, D, N, H]: ablate head 3 of layer 2
    edited = jax.tree.map(lambda x: x, model.params)
    edited["layers"]["attn"]["q_proj"] = q_proj.at[2, :, 3].set(0.0)
    after = llm_jax.forward(edited, model.config, tokens, backend=model.backend)
    assert float(jnp.max(jnp.abs(after - before))) > 1e-3
    reference = llm_jax.forward(edited, model.config, tokens, backend="xla")
    np.testing.assert_allclose(np.asarray(after), np.asarray(reference), atol=1e-4, rtol=0)
    # a model built from the edited params runs them (its execution form is derived from them anew)
    import dataclasses

    ablated = dataclasses.replace(model, params=edited)
    first = llm_jax.generate(ablated, [PROMPT], max_new_tokens=1)[0].output_ids[0]
    assert first == int(jnp.argmax(reference[0, -1]))


def test_load_mesh_and_checkpoint_give_the_same_tree(stories260k_dir, tmp_path):
    """The params from ``load`` on one CPU device, from ``load(..., mesh=...)`` (8 simulated devices, in
    a fresh process) and from ``load_checkpoint``: identical paths, shapes and dtypes."""
    here = _layout(llm_jax.load(stories260k_dir / "stories260K.bin").params)
    convert(stories260k_dir / "stories260K.bin", tmp_path / "ckpt")
    _, restored, _ = load_checkpoint(tmp_path / "ckpt")
    assert _layout(restored) == here
    script = ("import json, llm_jax; from llm_jax.weights.placement import leaves_by_path\n"
              f"m = llm_jax.load({str(tmp_path / 'ckpt')!r}, mesh='data=2,model=4')\n"
              "print(json.dumps({'/'.join(p): [list(x.shape), x.dtype.name] for p, x in leaves_by_path(m.params).items()}))\n"
              "print(type(m.backend).__name__)")
    done = subprocess.run([PYTHON, "-c", script], env=cpu_devices_env(8), capture_output=True, text=True,
                          timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    layout, backend = done.stdout.strip().splitlines()[-2:]
    assert json.loads(layout) == here and backend == "Xla"


def test_runtime_choices_are_not_saved(stories260k_dir, tmp_path):
    model = llm_jax.load(stories260k_dir / "stories260K.bin", backend="pallas")
    save_checkpoint(tmp_path / "ckpt", config=model.config, params=model.params)
    text = json.dumps(json.loads((tmp_path / "ckpt" / "checkpoint.json").read_text())["config"])
    assert "pallas" not in text and "attention_impl" not in text and "matmul_impl" not in text
    # a config written by an earlier version, with its runtime fields, still loads
    old = llm_jax.ModelConfig.from_dict({**model.config.to_dict(), "attention_impl": "pallas", "matmul_impl": "xla"})
    assert old == model.config
