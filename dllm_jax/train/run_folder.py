"""A training run's directory: its checkpoints (Orbax), configuration, checksums, loss history and plot.

  checkpoints/<step>/         Orbax (CheckpointManager) trees of {params, opt_state, step, rng}; the last two
  checkpoint_checksums.json   CRC-32 of every array of each kept checkpoint, written before it commits
  train_config.json           the run's configuration and batch settings (a resume must match them)
  history.json                the per-step loss record, rewritten at every checkpoint
  loss.png                    the loss curve (when matplotlib is installed)
Every JSON file is replaced atomically (`dllm_jax.files.write_atomic`). A run directory is new, empty or
a run's own, never inside another run (`check_run_location`)."""

from __future__ import annotations

import dataclasses
import io
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from dllm_jax.checkpoint.manifest import CHUNK_BYTES, file_checksum, files_under, tree_checksums
from dllm_jax.files import write_atomic
from dllm_jax.train.state import TrainConfig, TrainState


class Diverged(ValueError):
    """Training met a NaN or Inf (loss, gradient norm or state); nothing from that point was saved."""


def all_finite(tree) -> bool:
    """Whether every floating leaf of `tree` is finite (one compiled reduction, one host sync)."""
    leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating)]
    return bool(_all_finite(leaves)) if leaves else True


@jax.jit
def _all_finite(leaves):
    # one program per tree: leaf by leaf, each shape would be a program (two) of its own to compile
    return jnp.stack([jnp.isfinite(x).all() for x in leaves]).all()


CONFIG_FILE, HISTORY_FILE, PLOT_FILE, CHECKPOINTS = "train_config.json", "history.json", "loss.png", "checkpoints"
CHECKSUMS_FILE = "checkpoint_checksums.json"
RUN_MARKERS = (CONFIG_FILE, CHECKPOINTS)  # what makes a directory a training run's


def run_differences(old: dict, config: TrainConfig, batch_settings: dict | None = None) -> dict[str, tuple]:
    """{key: (stored value, new value)} of what a resume would change in the run `old` (its
    train_config.json): the config's fields but bookkeeping and `steps`, and the batch settings. A config
    field added since the run was written reads as its default (the behaviour that run had); a run written
    before batch settings were recorded has none to compare."""
    new = json.loads(json.dumps(config.to_json()))
    old = {f.name: f.default for f in dataclasses.fields(config) if f.default is not dataclasses.MISSING} | old
    # attention_chunk trades memory for chunks; the loss is the same
    free = {"run_dir", "checkpoint_every", "log_every", "steps", "batches", "attention_chunk"}
    changed = {k: (old.get(k), new.get(k)) for k in sorted(set(old) | set(new))
               if k not in free and old.get(k) != new.get(k)}
    if batch_settings is not None and "batches" in old:
        settings, stored = json.loads(json.dumps(batch_settings)), old["batches"]
        changed |= {f"batches.{k}": (stored.get(k), settings.get(k)) for k in sorted(set(stored) | set(settings))
                    if stored.get(k) != settings.get(k)}
    return changed


def check_same_run(old: dict, config: TrainConfig, path: Path, batch_settings: dict | None = None) -> None:
    """ValueError naming the fields a resume would change (only bookkeeping and `steps` may differ)."""
    changed = run_differences(old, config, batch_settings)
    if changed:
        raise ValueError(f"cannot resume: the configuration differs from the run's {path} in {sorted(changed)}")


def read_json(path: Path, what: str):
    """The JSON value of `path`; ValueError naming the file when it cannot be read or parsed."""
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} ({what}) cannot be read: {e}; restore it, or remove it and start a new "
                         "run") from None


def check_run_location(run_dir: Path) -> None:
    """ValueError unless `run_dir` is a new or empty directory, or a training run's own: never inside
    another run's tree (its checkpoint rotation or export would delete this one) and never a directory of
    other files (an HF checkpoint, another tool's output)."""
    real_dir = run_dir.resolve()
    for parent in real_dir.parents:
        if any((parent / marker).exists() for marker in RUN_MARKERS):
            raise ValueError(f"run directory {run_dir} (resolved: {real_dir}) is inside the training run {parent}: "
                             "that run's checkpoint rotation and export would delete files of this one; choose a "
                             "directory outside it")
    if run_dir.exists() and not run_dir.is_dir():
        raise ValueError(f"run directory {run_dir} exists and is not a directory")
    if run_dir.is_dir() and any(run_dir.iterdir()) and not any((run_dir / m).exists() for m in RUN_MARKERS):
        found = sorted(p.name for p in run_dir.iterdir())
        raise ValueError(f"run directory {run_dir} holds files that are not a training run's ({found[:10]}): "
                         "choose a new or empty directory")


@dataclasses.dataclass(frozen=True)
class Run:
    """A run directory: its checkpoint manager, configuration, checksums and history."""

    directory: Path

    def open(self, config: TrainConfig, *, resume: bool, batch_settings: dict | None = None):
        """The run's checkpoint manager, after checking the directory against `config` and `resume`."""
        check_run_location(self.directory)
        stored = self.directory / CONFIG_FILE
        latest = self.latest_step()
        if latest is not None:
            if not resume:
                raise ValueError(f"{self.directory} already holds checkpoints (latest step {latest}): pass "
                                 "resume=True (--resume) to continue, or choose another directory")
            if not stored.is_file():
                raise ValueError(f"cannot resume {self.directory}: its {CONFIG_FILE} is missing, so the run's "
                                 "settings cannot be checked against this call's")
            check_same_run(read_json(stored, "the run's configuration"), config, stored, batch_settings)
        self.directory.mkdir(parents=True, exist_ok=True)
        manager = self.manager()
        record = config.to_json() | ({} if batch_settings is None else {"batches": batch_settings})
        write_atomic(stored, json.dumps(record, indent=2) + "\n")
        return manager

    def manager(self) -> ocp.CheckpointManager:
        return ocp.CheckpointManager(self.directory.absolute() / CHECKPOINTS,
                                     options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True))

    def latest_step(self) -> int | None:
        """The latest committed checkpoint's step (None: none), creating nothing."""
        if not (self.directory / CHECKPOINTS).is_dir():
            return None
        with self.manager() as manager:
            return manager.latest_step()

    def save(self, manager: ocp.CheckpointManager, state: TrainState, history: list[dict]) -> None:
        """Checkpoints `state` (refusing a non-finite one: the kept checkpoints stay the last finite ones)
        with its checksums, and writes the history up to it (a killed call keeps its records)."""
        step = int(state.step)
        tree = dataclasses.asdict(state)
        if not all_finite(tree):
            raise Diverged(f"training diverged: the parameters or optimizer state hold NaN or Inf after step "
                           f"{step}; not saved, the last checkpoint is step {manager.latest_step()}")
        # the checksums are recorded before the checkpoint commits: a kill between the two leaves a record of
        # a step that does not exist, never a step without its record
        self.record_files(manager)  # the saves before this one, committed (Orbax waits for them before a new one)
        self.record_checksums(step, tree_checksums(jax.device_get(tree)), keep=manager.all_steps())
        manager.save(step, args=ocp.args.StandardSave(tree))
        self.write_history([r for r in history if r["step"] <= step], plot=False)

    def checksums(self) -> dict:
        """The checksums file: {"steps": {step: array checksums}, "files": {step: {file: [bytes, CRC-32]}}}."""
        path = self.directory / CHECKSUMS_FILE
        return read_json(path, "checkpoint checksums") if path.is_file() else {}

    def write_checksums(self, steps: dict, files: dict) -> None:
        write_atomic(self.directory / CHECKSUMS_FILE, json.dumps({"checksum": "crc32", "chunk_bytes": CHUNK_BYTES,
                                                                  "steps": steps, "files": files}) + "\n")

    def record_checksums(self, step: int, checksums: dict, *, keep) -> None:
        record, kept = self.checksums(), {int(s) for s in keep}
        steps = {s: v for s, v in record.get("steps", {}).items() if int(s) in kept} | {str(step): checksums}
        self.write_checksums(steps, {s: v for s, v in record.get("files", {}).items() if int(s) in kept})

    def record_files(self, manager: ocp.CheckpointManager) -> None:
        """Records each committed checkpoint's files (bytes and CRC-32) once, after waiting for the save in flight:
        `restore` checks them before Orbax reads any (a damaged file then fails by name, not inside Orbax's
        asynchronous reads, whose abandoned tasks print tracebacks as the process exits)."""
        manager.wait_until_finished()
        record = self.checksums()
        files = record.get("files", {})
        new = {}
        for step in manager.all_steps():
            if str(step) not in files:
                where = self.directory / CHECKPOINTS / str(step)
                new[str(step)] = {name: [(where / name).stat().st_size, file_checksum(where / name)]
                                  for name in files_under(where)}
        if new:
            self.write_checksums(record.get("steps", {}), files | new)

    @staticmethod
    def check_files(where: Path, recorded: dict, remedy: str) -> None:
        """ValueError naming the first file of the checkpoint in `where` that is missing or differs from its record
        (`recorded`: {file: [bytes, CRC-32]}; empty for a checkpoint recorded before file records existed, which
        Orbax's reads alone check)."""
        for name, (size, crc) in recorded.items():
            path = where / name
            if not path.is_file():
                raise ValueError(f"checkpoint {where} is damaged: its file {name} is missing; {remedy}")
            if path.stat().st_size != size:
                raise ValueError(f"checkpoint {where} is damaged: its file {name} holds {path.stat().st_size:,} bytes, "
                                 f"{size:,} when it was written (truncated?); {remedy}")
            if file_checksum(path) != crc:
                raise ValueError(f"checkpoint {where} is damaged: the bytes of its file {name} differ from those "
                                 f"written (CRC-32); {remedy}")

    def restore(self, manager: ocp.CheckpointManager, like: TrainState) -> TrainState:
        """The latest checkpoint, restored into the structure, shapes and dtypes of `like`, checked against
        its checksums and for non-finite values."""
        step = manager.latest_step()
        where = self.directory / CHECKPOINTS / str(step)
        remedy = (f"remove {where} to resume from the checkpoint before it, or start a new run")
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, dataclasses.asdict(like))
        record = self.checksums()
        self.check_files(where, record.get("files", {}).get(str(step), {}), remedy)
        try:
            restored = manager.restore(step, args=ocp.args.StandardRestore(abstract))
        except Exception as e:  # Orbax / TensorStore raise many types for a truncated or corrupt file
            said = str(e).splitlines()[0].split(" See full TensorStore details")[0] if str(e) else ""
            raise ValueError(f"checkpoint {where} cannot be read (damaged or truncated: {type(e).__name__}: "
                             f"{said}); {remedy}") from None
        path = self.directory / CHECKSUMS_FILE
        recorded = record.get("steps", {}).get(str(step))
        if recorded is None:
            print(f"warning: {path} records no checksums of step {step} (a run written before they existed): "
                  "its values are checked for NaN/Inf only", file=sys.stderr)
        else:
            found = tree_checksums(jax.device_get(restored))
            bad = sorted(k for k in set(found) | set(recorded) if found.get(k) != recorded.get(k))
            if bad:
                raise ValueError(f"checkpoint {where} is damaged: {len(bad)} arrays differ from the checksums "
                                 f"written with it ({bad[:5]}); {remedy}")
        if not all_finite(restored):
            raise ValueError(f"checkpoint {where} holds NaN or Inf values; {remedy}")
        return TrainState(**restored)

    def read_history(self) -> list[dict]:
        path = self.directory / HISTORY_FILE
        if not path.is_file():
            return []
        history = read_json(path, "the loss history")
        if not (isinstance(history, dict) and isinstance(history.get("steps"), list)):
            raise ValueError(f"{path} (the loss history) is not a {{\"steps\": [...]}} object; restore it, or "
                             "remove it (the resumed run then keeps only the losses from here on)")
        return history["steps"]

    def write_history(self, history: list[dict], *, plot: bool) -> None:
        """history.json and, with plot=True and matplotlib installed, loss.png (a message otherwise)."""
        write_atomic(self.directory / HISTORY_FILE, json.dumps({"steps": history}, indent=1) + "\n")
        if not plot:
            return
        try:
            write_atomic(self.directory / PLOT_FILE, loss_plot_png(history))
        except ImportError:
            print(f"matplotlib is not installed: no loss curve ({self.directory / PLOT_FILE}); the losses are in "
                  f"{self.directory / HISTORY_FILE}")


def loss_plot_png(history: list[dict]) -> bytes:
    """The loss curve as PNG bytes."""
    from matplotlib.figure import Figure  # the object API: no pyplot state, no GUI backend

    fig = Figure(figsize=(7, 4))
    ax = fig.add_subplot()
    steps = [r["step"] for r in history]
    ax.plot(steps, [r["loss"] for r in history], lw=0.8, label="loss (1/t weighted)")
    ax.plot(steps, [r["ce"] for r in history], lw=0.8, label="CE of masked tokens")
    ax.set_xlabel("step")
    ax.set_yscale("log")
    ax.legend()
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=120)
    return buffer.getvalue()


# --- export ---
