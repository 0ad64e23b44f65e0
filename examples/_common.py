"""What the example scripts share: the training loop, checkpoints with resume, plots."""

import pathlib
from collections.abc import Callable

import equinox as eqx
import jax
import numpy as np
from tqdm import tqdm


def train(step: Callable, state: tuple, steps: int, key, *, desc: str = "train"):
    """Run `state, metrics = step(state, key)` `steps` times; returns state and metric lists."""
    history: dict[str, list[float]] = {}
    progress = tqdm(jax.random.split(key, steps), desc=desc, mininterval=2.0)
    for n, step_key in enumerate(progress):
        state, metrics = step(state, step_key)
        for name, value in metrics.items():
            history.setdefault(name, []).append(float(value))
        if n % 50 == 0:
            progress.set_postfix({k: f"{v[-1]:.3f}" for k, v in history.items()})
    return state, history


def save(path: pathlib.Path, state) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    eqx.tree_serialise_leaves(path, state)


def resume(path: pathlib.Path | None, state):
    """`state` with its leaves read from `path` (a checkpoint of the same structure).

    The optimiser state keeps its step count, so a schedule continues where it stopped:
    `--steps` is the schedule's total length, counted across resumed runs.
    """
    if path is None:
        return state
    print(f"resuming from {path}")
    return eqx.tree_deserialise_leaves(path, state)


def check_round_trip(path: pathlib.Path, state) -> None:
    """Save `state`, read it back into the same structure, and compare every array."""
    save(path, state)
    restored = eqx.tree_deserialise_leaves(path, state)
    arrays = lambda s: jax.tree.leaves(eqx.filter(s, eqx.is_array))  # noqa: E731
    if not all(np.array_equal(a, b) for a, b in zip(arrays(state), arrays(restored))):
        raise RuntimeError("checkpoint round trip changed the parameters")
    print(f"checkpoint saved and reloaded: {path}")


def plot(path: pathlib.Path, panels: dict[str, dict[str, list[float]]], *, kind="line") -> None:
    """One panel per entry: curves (`kind="line"`) or bars (`kind="bar"`) by name."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.5), squeeze=False)
    for ax, (title, curves) in zip(axes[0], panels.items()):
        for name, values in curves.items():
            if kind == "bar":
                ax.bar(np.arange(len(values)), values, label=name)
            else:
                ax.plot(values, label=name)
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"plot written to {path}")
