"""The UloRL training loop (DESIGN.md "Data flow of one RL step").

Each RL step:
  1. draw `train_batch_size` new prompts (n samples each) and run one segment
     step over them plus the unfinished pool (ULORL.md §1, Algorithm 1);
  2. score the samples that ended (truncated ones get 0, §1 termination 3);
  3. move complete groups out of the experience pool, drop the ones whose
     rewards are all equal (DAPO dynamic sampling, §4), and keep rolling out
     fresh prompts until a batch of groups is ready or the refill budget is spent;
  4. GRPO advantages, learner update(s) with POIS/SAIS and the DMMPT mask;
  5. hand the new weights to the engine (same device arrays, no host round
     trip, no recompile: params are an argument of every jitted engine call);
  6. log, evaluate every `eval_every` steps, checkpoint every `save_every`.

With several processes (`jax.distributed`, `jax.process_count() > 1`) every
process runs this same loop: the rollout is a `DistributedRollout` (each
process decodes its contiguous share of the step's prompts with a local copy
of the params, scores it, and the ended samples are gathered), so the
experience pool, the groups and the learner's batch are the same everywhere
and the learner step runs over the global mesh. Process 0 alone writes
config.yaml, metrics and TensorBoard; every process takes part in the
checkpoint save (a collective), which stores each process's unfinished pool.

Everything the next step depends on — params, optimizer state, step, policy
version, data position, both pools and the groups waiting for an update — is
in the checkpoint, and the step's randomness is `fold_in(seed, step)`, so a
resumed run continues exactly as the uninterrupted one would have.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

from ulorl_jax.checkpoint import CheckpointError, TrainCheckpointer
from ulorl_jax.config import RunConfig, config_to_yaml
from ulorl_jax.data.sources import (
    ProblemStream,
    SyntheticTask,
    eval_prompts,
    prompt_file_stream,
)
from ulorl_jax.decode.placement import (
    decode_placement,
    device_memory_bytes,
    resolve_kind,
    weight_bytes,
)
from ulorl_jax.memory import (
    check_train_memory,
    format_bytes,
    memory_budget,
    train_memory,
)
from ulorl_jax.metrics import MetricsWriter
from ulorl_jax.model_source import build_tokenizer
from ulorl_jax.rl.advantages import (
    dynamic_sampling_report,
    grpo_advantages_host,
)
from ulorl_jax.rl.build import (
    build_engine,
    build_mesh,
    build_model,
    build_scorer,
    eval_sampling_params,
    learner_config,
    rollout_config,
)
from ulorl_jax.rl.evaluation import evaluate, score_samples
from ulorl_jax.rl.hooks import StepHook, default_hooks, run_hooks
from ulorl_jax.rl.learner import Learner
from ulorl_jax.rl.packing import TrainSample
from ulorl_jax.rl.reward_shaping import shaped_rewards
from ulorl_jax.rollout.backends import make_segment_rollout
from ulorl_jax.rollout.distributed import DistributedRollout
from ulorl_jax.run_paths import (
    check_paths_exist,
    resolve_flat,
    resolve_paths,
    used_paths,
)
from ulorl_jax.types import Sample

log = logging.getLogger(__name__)


class TrainingError(RuntimeError):
    """The run cannot go on (e.g. too many steps without a trainable group)."""


# Keys a resumed run may change (how long, how often to log / evaluate / save); any other
# difference from the run's saved config.yaml would silently change the experiment.
RESUME_MUTABLE_PREFIXES = ("trainer.total_steps", "trainer.eval_every", "checkpoint.", "logging.", "eval.")


def check_resume_config(saved_path: Path, cfg: RunConfig) -> None:
    if not saved_path.exists():
        return
    import yaml

    from ulorl_jax.config import config_to_dict, remat_policy

    def flat(tree, prefix=""):
        out = {}
        for key, value in (tree or {}).items():
            name = f"{prefix}{key}"
            if isinstance(value, dict) and key not in ("arch", "overrides", "synthetic"):
                out.update(flat(value, name + "."))
            else:
                out[name] = value
        return out

    # Paths compared absolute: an older run's config.yaml holds them as given, relative to the working directory.
    saved = resolve_flat(flat(yaml.safe_load(saved_path.read_text())))
    now = resolve_flat(flat(config_to_dict(cfg)))
    if isinstance(saved.get("trainer.remat"), bool):  # run folders written before remat took policy names
        saved["trainer.remat"] = remat_policy(saved["trainer.remat"])
    changed = sorted(k for k in set(saved) | set(now)
                     if saved.get(k) != now.get(k) and not k.startswith(RESUME_MUTABLE_PREFIXES))
    if changed:
        details = "; ".join(f"{k}: {saved.get(k)!r} -> {now.get(k)!r}" for k in changed[:8])
        raise ValueError(f"--resume with a config that differs from the run's {saved_path} in {len(changed)} key(s) "
                         f"({details}); resume with the same config (only {', '.join(RESUME_MUTABLE_PREFIXES)} "
                         f"may change) or start a new --run-dir")


# ---------------------------------------------------------------------------
# Held-out evaluation (avg@k)
# ---------------------------------------------------------------------------


# ---------------------------------------------------------------------------
# The trainer
# ---------------------------------------------------------------------------


def _missing_folders(path: Path) -> list[Path]:
    """`path` and its ancestors that do not exist yet, deepest first (what `mkdir(parents=True)` creates)."""
    missing = []
    for p in (path.absolute(), *path.absolute().parents):
        if p.exists():
            break
        missing.append(p)
    return missing


def _remove_created(run_dir: Path, created: list[Path]) -> None:
    """Remove a run folder this process created (`created`: from `_missing_folders`) unless it holds a
    committed checkpoint, then the parents it created while they are empty. A folder that existed before
    is never touched."""
    import shutil

    if not created:
        return
    ckpt_dir = run_dir / "checkpoints"
    if ckpt_dir.is_dir() and any(p.name.isdigit() for p in ckpt_dir.iterdir()):
        return
    shutil.rmtree(created[0], ignore_errors=True)
    for parent in created[1:]:
        try:
            parent.rmdir()  # only when empty: another run may have started beside this one
        except OSError:
            break


class _NoMetrics:
    """The metrics writer of processes other than 0 (process 0 writes the run's files)."""

    def write(self, step: int, metrics: dict) -> dict:
        return metrics

    def close(self) -> None:
        pass


@dataclasses.dataclass
class StepTimes:
    rollout: float = 0.0
    reward: float = 0.0
    learn: float = 0.0
    sync: float = 0.0


class Trainer:
    """Owns engine, rollout, learner, reward scorer, data, metrics and checkpoints of one run."""

    def __init__(self, cfg: RunConfig, run_dir: str | Path, *, resume: bool = False,
                 on_step: Callable[[int, dict], None] | None = None,
                 length_oracle: Callable[[Sample], int | None] | None = None, max_memory_gb: float | None = None):
        """`length_oracle` (tests, benchmarks): ends a sample as if EOS at the length it returns.
        `max_memory_gb`: the memory budget per device checked before allocating (default: the device's free
        memory, or 80% of host RAM on CPU; `memory.py`).

        Everything that can refuse the run (config, paths, tokenizer, data, reward function, memory, model,
        learner, engine) runs before the run folder is made; if what follows fails before step 0 (restore,
        config.yaml, metrics writer), a folder this call created is removed again (`_make_run_folder`)."""
        # Path-valued options absolute, against the directory the run starts from (run_paths.py): the run
        # folder's config.yaml then works from any working directory.
        cfg = resolve_paths(cfg)
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.on_step = on_step
        self.process_count = jax.process_count()
        self.is_primary = jax.process_index() == 0
        self._check_run_folder(resume)
        t = cfg.trainer
        if t.sft_steps and cfg.data.synthetic is None:
            raise ValueError(f"trainer.sft_steps={t.sft_steps} needs data.synthetic (warm-start traces are "
                             f"generated): set trainer.sft_steps=0 to train on data.train_files")
        check_paths_exist(cfg, used_paths(cfg))
        self.scorer = build_scorer(cfg)  # imports reward.custom_fn: a bad one fails before anything is built
        try:
            self._build(length_oracle, max_memory_gb)
            self._make_run_folder(resume)
        except BaseException:
            self.scorer.close()
            raise

    def _check_run_folder(self, resume: bool) -> None:
        """Read-only checks of an existing run folder: a fresh run refuses one with checkpoints; --resume
        refuses a config that changes the experiment."""
        ckpt_dir = self.run_dir / "checkpoints"
        # Committed steps only: a run killed while writing its first checkpoint leaves just orbax's tmp folder.
        if not resume and ckpt_dir.is_dir() and any(p.name.isdigit() for p in ckpt_dir.iterdir()):
            raise ValueError(f"{ckpt_dir} already holds checkpoints: pass --resume to continue that run, "
                             f"or choose a new --run-dir (nothing is overwritten)")
        if resume:
            check_resume_config(self.run_dir / "config.yaml", self.cfg)

    def _build(self, length_oracle, max_memory_gb: float | None) -> None:
        """Tokenizer, data, model, memory check, learner, engine and rollout: nothing on disk yet."""
        cfg, t, r = self.cfg, self.cfg.trainer, self.cfg.rollout
        self.hooks = default_hooks(cfg)  # eval, reward stats, non-finite guard, checkpoint (rl/hooks.py)
        self.tokenizer = build_tokenizer(cfg)
        self.max_prompt_len = cfg.data.max_prompt_len or 1024
        self._build_data()
        model = build_model(cfg, self.tokenizer, seed=t.seed)
        positions = model.config.max_position_embeddings
        if self.max_prompt_len + r.global_max_len > positions:
            log.warning("data.max_prompt_len %d + rollout.global_max_len %d = %d tokens exceed the model's %d "
                        "positions (max_position_embeddings): longer samples run past what it was trained on",
                        self.max_prompt_len, r.global_max_len, self.max_prompt_len + r.global_max_len, positions)
        self.mesh = build_mesh(cfg)
        slots = r.max_concurrent_decodes or t.train_batch_size * r.n
        eval_len = cfg.eval.max_new_tokens or r.global_max_len
        max_len = self.max_prompt_len + max(r.global_max_len, eval_len)
        self._check_memory(model, slots, max_len, max_memory_gb)
        self.learner = Learner(model, learner_config(cfg), self.mesh)
        self.placement = decode_placement(r.decode_mesh, self.mesh, self.learner.params)
        log.info("rollout decodes on %s (rollout.decode_mesh=%s)",
                 self.placement.describe(weight_bytes(self.learner.params)), r.decode_mesh)
        rollout_cfg = rollout_config(cfg, model, self.tokenizer, self.max_prompt_len)
        self.engine = build_engine(cfg, model, self.tokenizer, slots=slots, max_len=max_len,
                                   sampling=rollout_cfg.sampling, mesh=self.placement.engine_mesh)
        self.rollout = make_segment_rollout(self.engine, rollout_cfg, rollout_backend=r.backend,
                                            length_oracle=length_oracle)
        if self.process_count > 1:  # each process decodes its share of the prompts; ended samples are gathered
            self.rollout = DistributedRollout(self.rollout)
        self.step = 0
        self.policy_version = 0
        self.ready_groups: list[list[Sample]] = []  # kept by dynamic sampling, waiting for an update
        self.last_trained_groups: list[list[Sample]] = []  # for inspection (tests, debugging)
        self.shaping_metrics: dict[str, float] = {}  # the last train_samples' overlong-buffer metrics (if logged)
        self.consecutive_skips = 0
        self._skipped_tally: collections.Counter = collections.Counter()  # rewards of the steps that trained nothing
        self.consecutive_nonfinite = 0  # steps in a row whose every learner update was skipped (non-finite)
        self.nonfinite_updates_total = 0
        self.base_key = jax.random.PRNGKey(t.seed)

    def _make_run_folder(self, resume: bool) -> None:
        """The run folder, its checkpointer (restoring the latest checkpoint on --resume), config.yaml and the
        metrics writer. A failure here removes the folder if this call created it (and it holds no
        checkpoint): a run that never started leaves nothing on disk."""
        cfg = self.cfg
        created = _missing_folders(self.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.checkpointer = None
        try:
            self.checkpointer = TrainCheckpointer(self.run_dir / "checkpoints", keep_last=cfg.checkpoint.keep_last,
                                                  async_save=cfg.checkpoint.async_save)
            self.resumed = False  # True once a checkpoint was restored
            if resume:
                if self.checkpointer.latest_step() is None:  # killed before its first checkpoint: nothing to lose
                    log.warning("--resume: no committed checkpoint in %s (the run stopped before its first one); "
                                "starting it from step 1", self.checkpointer.directory)
                else:
                    self._restore()
                    self.resumed = True
            self.writer = _NoMetrics()
            if self.is_primary:
                # Atomic: the other processes of a resumed run may be reading it (check_resume_config).
                tmp = self.run_dir / "config.yaml.tmp"
                tmp.write_text(config_to_yaml(cfg))
                tmp.replace(self.run_dir / "config.yaml")
                self.writer = MetricsWriter(self.run_dir, tensorboard=cfg.logging.tensorboard, wandb=cfg.logging.wandb,
                                            wandb_project=cfg.logging.wandb_project,
                                            resume_step=self.step + 1)  # drops lines no checkpoint covers
        except BaseException:
            if self.checkpointer is not None:
                try:
                    self.checkpointer.close()
                except Exception as err:  # the setup error is the one to report
                    log.debug("closing the checkpointer after a failed setup: %s", err)
            _remove_created(self.run_dir, created)
            raise

    # -- data --------------------------------------------------------------------------

    def _build_data(self) -> None:
        cfg = self.cfg
        if cfg.data.synthetic is None:
            self.task = None
            if not cfg.data.train_files:
                raise ValueError("data.train_files is empty and data.synthetic is null: no prompts to train on")
            self.prompts = self._prompt_stream(cfg.data.train_files, shuffle=True)
            self.eval_set = []
            if cfg.data.eval_files:
                stream = self._prompt_stream(cfg.data.eval_files, shuffle=False, held_out=True)
                self.eval_set = stream.take(len(stream))
            return
        self.task = SyntheticTask.from_options(cfg.data.synthetic)
        self.prompts = ProblemStream(self.task.train, self.tokenizer, seed=cfg.data.shuffle_seed,
                                     apply_chat_template=cfg.data.apply_chat_template)
        self.eval_set = eval_prompts(self.task.eval, self.tokenizer, cfg.data.apply_chat_template)

    def _prompt_stream(self, files: list[str], shuffle: bool, held_out: bool = False):
        return prompt_file_stream(files, self.cfg.data, self.tokenizer, self.max_prompt_len, shuffle=shuffle,
                                  held_out=held_out)

    # -- supervised warm start (the demo's "sometimes wrong" traces) -------------------

    def warm_start(self, steps: int, batch: int, lr: float, progress: Callable[[int, dict], None] | None = None
                   ) -> list[dict]:
        """`steps` supervised updates on noisy synthetic traces with their own AdamW at `lr`;
        the RL learner then starts from those weights with a fresh optimizer state."""
        if self.task is None:
            raise ValueError("trainer.sft_steps > 0 needs data.synthetic (warm-start traces are generated)")
        sft = Learner(self.learner.model, dataclasses.replace(self.learner.config, lr=lr, warmup_steps=0,
                                                              ppo_mini_batch_size=None), self.mesh)
        eos = self.rollout.config.eos_token_ids[0]
        history = []
        for i in range(steps):
            pairs = self.task.warm_start_traces(i, batch)
            samples = [TrainSample(prompt_ids=self.prompts_ids(p.prompt),
                                   response_ids=list(self.tokenizer.encode(trace, add_special_tokens=False)) + [eos],
                                   advantage=0.0, reward=0.0, logprobs=None) for p, trace in pairs]
            metrics = sft.sft_update(samples)
            history.append(metrics)
            if progress:
                progress(i + 1, metrics)
        self.learner.load_state_dict({"params": sft.params, "opt_state": self.learner.opt_state,
                                      "step": self.learner.step})
        return history

    def prompts_ids(self, text: str) -> list[int]:
        from ulorl_jax.data.sources import encode_prompt

        return encode_prompt(self.tokenizer, text, self.cfg.data.apply_chat_template)

    def _check_memory(self, model, slots: int, max_len: int, max_memory_gb: float | None) -> None:
        """Refuse, before the learner and engine allocate, a run whose state cannot fit (memory.py)."""
        from flax import nnx

        weights = weight_bytes(nnx.state(model, nnx.Param))
        mesh = self.mesh
        local = jax.local_device_count()
        kind = resolve_kind(self.cfg.rollout.decode_mesh, jax.process_count(), weights,
                            device_memory_bytes(jax.local_devices()[0]))
        decode_devices = {"learner": mesh.size, "first_device": 1}.get(kind, local)
        need = train_memory(model.config, weights, learner_shards=mesh.size // mesh.shape.get("data", 1),
                            decode_kind=kind, decode_devices=decode_devices, slots=slots, max_len=max_len,
                            shared_host=jax.default_backend() == "cpu")
        budget, where = memory_budget(max_memory_gb)
        check_train_memory(need, budget, where, slots=slots, max_len=max_len)
        log.info("memory before activations: %s of %s (%s)", format_bytes(need.total), format_bytes(budget), where)

    # -- one RL step -------------------------------------------------------------------

    def decode_params(self):
        """The params the engine decodes with (`decode/placement.py`): the learner's own arrays, or their
        copies on this process's decode mesh (a collective: every process calls it)."""
        return self.placement.params(self.learner.params)

    def _score(self, samples: list[Sample], times: StepTimes) -> list[float]:
        t0 = time.perf_counter()
        rewards = score_samples(samples, self.scorer, self.tokenizer)
        times.reward += time.perf_counter() - t0
        return rewards

    def _rollout_round(self, key, times: StepTimes, acc: dict) -> None:
        prompts = self.prompts.take(self.cfg.trainer.train_batch_size)
        # One interface for the local, JetStream and distributed rollouts: the samples that end are scored
        # inside the step (with several processes each scores its own share before the gather).
        t0, reward_s = time.perf_counter(), times.reward
        report = self.rollout.step(self.decode_params(), prompts, self.policy_version, key,
                                   score=lambda ended: self._score(ended, times))
        times.rollout += time.perf_counter() - t0 - (times.reward - reward_s)
        rewards = [s.metadata["reward"] for s in report.ended]
        acc["reports"].append(report)
        acc["ended"] += report.ended
        acc["rewards"] += rewards
        groups = self.rollout.experience_pool.pop_complete_groups()
        if not groups:
            return
        group_rewards = np.asarray([[s.metadata["reward"] for s in g] for g in groups], np.float32)
        acc["groups"] += len(groups)
        if self.cfg.algorithm.dynamic_sampling:
            ds = dynamic_sampling_report(group_rewards)
            acc["dropped_all_correct"] += ds.dropped_all_correct
            acc["dropped_all_wrong"] += ds.dropped_all_wrong
            acc["dropped_other"] += ds.dropped_other_constant
            groups = [g for g, k in zip(groups, ds.keep) if k]
        self.ready_groups += groups

    def train_samples(self, groups: list[list[Sample]]) -> list[TrainSample]:
        rewards = np.asarray([[s.metadata["reward"] for s in g] for g in groups], np.float32)
        # DAPO's overlong buffer shapes the advantages' reward only (rl/reward_shaping.py)
        lengths = np.asarray([[len(s.response_ids) for s in g] for g in groups])
        shaped, self.shaping_metrics = shaped_rewards(rewards, lengths, self.cfg.rollout.global_max_len,
                                                      self.cfg.reward.overlong_buffer)
        adv = grpo_advantages_host(shaped, norm_by_std=self.cfg.algorithm.norm_adv_by_std)
        return [TrainSample(prompt_ids=s.prompt_ids, response_ids=s.response_ids, advantage=float(adv[i, j]),
                            reward=float(s.metadata["reward"]), logprobs=s.logprobs)
                for i, g in enumerate(groups) for j, s in enumerate(g)]

    def train_step(self) -> dict[str, Any]:
        """One RL step; returns the metrics written to metrics.jsonl."""
        t = self.cfg.trainer
        start = time.perf_counter()
        times = StepTimes()
        acc = {"reports": [], "ended": [], "rewards": [], "groups": 0, "dropped_all_correct": 0,
               "dropped_all_wrong": 0, "dropped_other": 0}
        step_key = jax.random.fold_in(self.base_key, self.step)
        rounds = 0
        while True:
            self._rollout_round(jax.random.fold_in(step_key, rounds), times, acc)
            rounds += 1
            if len(self.ready_groups) >= t.train_batch_size or rounds >= max(1, t.dynamic_sampling_max_rounds):
                break
        metrics: dict[str, Any] = {}
        if self.ready_groups:
            groups, self.ready_groups = self.ready_groups, []
            self.last_trained_groups = groups
            samples = self.train_samples(groups)
            t0 = time.perf_counter()
            learn = self.learner.update(samples)
            times.learn = time.perf_counter() - t0
            if learn["skipped"] < learn["updates"]:  # the weights changed
                self.policy_version += 1
            self.consecutive_skips = 0
            self._skipped_tally.clear()
            metrics.update(learn)
            metrics.update(self._nonfinite_guard(learn))
            metrics.update(self.shaping_metrics)
            metrics["trained_samples"] = len(samples)
            # Which samples this step consumed: a resumed run can be checked to train each exactly once.
            metrics["trained_uids"] = sorted(s.uid for g in groups for s in g)
            metrics["trained_groups"] = len(groups)
            metrics["learner_tokens_per_s"] = learn.get("tokens", 0.0) / max(times.learn, 1e-9)
            versions = [v for g in groups for s in g for v in s.policy_versions]
            metrics["policy_version_spread"] = (max(versions) - min(versions)) if versions else 0
        else:
            self.consecutive_skips += 1
            metrics["trained_samples"] = 0
            for key in ("dropped_all_wrong", "dropped_all_correct", "dropped_other"):
                self._skipped_tally[key] += acc[key]
            self._skipped_tally["ended"] += len(acc["rewards"])
            self._skipped_tally["reward_sum"] += float(np.sum(acc["rewards"])) if acc["rewards"] else 0.0
            if self.consecutive_skips > t.max_consecutive_skips:
                raise TrainingError(self._nothing_trained_message())
        # Weight sync: the engine's calls take the learner's current param arrays as an argument
        # (same devices, no host copy, no recompile); timing the handover keeps the split honest.
        t0 = time.perf_counter()
        jax.block_until_ready(self.learner.params)
        times.sync = time.perf_counter() - t0
        self.step += 1
        metrics.update(self._rollout_metrics(acc, times))
        metrics["step_seconds"] = time.perf_counter() - start
        metrics["policy_version"] = self.policy_version
        metrics["rollout_rounds"] = rounds
        run_hooks(self.hooks, "metrics", self, self.step, metrics)
        self.writer.write(self.step, metrics)
        run_hooks(self.hooks, "after", self, self.step, metrics)
        return metrics

    def add_hook(self, fn: Callable[[Trainer, dict], None], *, every: int = 1, name: str | None = None,
                 stage: str = "after") -> None:
        """Run `fn(trainer, metrics)` after every `every`-th step: stage "metrics" before the step's metrics
        are written (it may add to them), "after" once they are (rl/hooks.py)."""
        self.hooks.append(StepHook(name or getattr(fn, "__name__", "hook"), every, fn, stage))

    def stop_if_nonfinite(self) -> None:
        """The non-finite guard: stop once trainer.max_consecutive_nonfinite steps in a row skipped every
        update for a non-finite loss or gradient."""
        t = self.cfg.trainer
        if self.consecutive_nonfinite >= t.max_consecutive_nonfinite:
            raise TrainingError(
                f"step {self.step}: {self.consecutive_nonfinite} consecutive steps whose every learner update had a "
                f"non-finite loss or gradient (all skipped, weights unchanged since the last good update); "
                f"trainer.max_consecutive_nonfinite={t.max_consecutive_nonfinite}. Resume from the last checkpoint "
                f"with a lower optim.lr or tighter optim.grad_clip, or inspect the data of these steps")

    def _nothing_trained_message(self) -> str:
        """Why the last steps trained nothing (the dropped groups' rewards) and what to try."""
        tally, t = self._skipped_tally, self.cfg.trainer
        ended = int(tally["ended"])
        mean = tally["reward_sum"] / ended if ended else float("nan")
        return (
            f"{self.consecutive_skips} consecutive steps trained nothing (trainer.max_consecutive_skips="
            f"{t.max_consecutive_skips}): {ended} samples ended with mean reward {mean:.3f}; dynamic sampling dropped "
            f"{int(tally['dropped_all_wrong'])} complete groups as all wrong (every reward 0), "
            f"{int(tally['dropped_all_correct'])} as all right (every reward 1) and {int(tally['dropped_other'])} "
            f"with other equal rewards; groups wait for all {self.cfg.rollout.n} samples to finish. A group whose "
            f"rewards are all equal has zero advantage: nothing to learn. Try: for an all-wrong policy, a warm start "
            f"or easier / cleaner data (check answers and rewards with `ulorl eval --model ... --data ...`); for an "
            f"all-right one, harder problems (`ulorl data clean --model` drops what the policy solves n/n); more "
            f"samples per prompt (rollout.n); or more rollout rounds per step (trainer.dynamic_sampling_max_rounds).")

    def _nonfinite_guard(self, learn: dict) -> dict[str, Any]:
        """Count updates the learner skipped for a non-finite loss / grad norm (it kept the old state)."""
        skipped, updates = int(learn["skipped"]), int(learn["updates"])
        self.nonfinite_updates_total += skipped
        self.consecutive_nonfinite = self.consecutive_nonfinite + 1 if skipped == updates else 0
        if skipped:
            log.warning("step %d: %d of %d learner updates skipped (non-finite loss %s or grad norm %s); "
                        "%d consecutive all-skipped steps (trainer.max_consecutive_nonfinite=%d)", self.step + 1,
                        skipped, updates, learn.get("loss"), learn.get("grad_norm"), self.consecutive_nonfinite,
                        self.cfg.trainer.max_consecutive_nonfinite)
        # No loss scaling here (f32 / bf16 keep f32's exponent range): overflow shows as these skips.
        return {"nonfinite_updates": skipped, "nonfinite_consecutive_steps": self.consecutive_nonfinite,
                "nonfinite_updates_total": self.nonfinite_updates_total}

    def _rollout_metrics(self, acc: dict, times: StepTimes) -> dict[str, Any]:
        ended, rewards, reports = acc["ended"], acc["rewards"], acc["reports"]
        lengths = [len(s.response_ids) for s in ended]
        decoded = sum(r.tokens_decoded for r in reports)
        return {
            "reward_mean": float(np.mean(rewards)) if rewards else None,
            "accuracy": float(np.mean([r >= 1.0 for r in rewards])) if rewards else None,
            "ended_samples": len(ended),
            "response_length_mean": float(np.mean(lengths)) if lengths else None,
            "response_length_max": int(max(lengths)) if lengths else None,
            "response_lengths": lengths,
            "truncated_fraction": float(np.mean([s.finish_reason == "length" for s in ended])) if ended else None,
            "segments_mean": float(np.mean([s.segments for s in ended])) if ended else None,
            "pool_unfinished": reports[-1].unfinished_pool_size,  # over every process
            "pool_experience": len(self.rollout.experience_pool),
            "groups_complete": acc["groups"],
            "groups_dropped_all_correct": acc["dropped_all_correct"],
            "groups_dropped_all_wrong": acc["dropped_all_wrong"],
            "groups_dropped_other": acc["dropped_other"],
            "groups_waiting": len(self.ready_groups),
            "rollout_tokens": decoded,
            "rollout_tokens_per_s": decoded / max(times.rollout, 1e-9),
            "slot_occupancy": float(np.mean([r.slot_occupancy for r in reports])) if reports else None,
            "decode_devices": max((r.decode_devices for r in reports), default=0),  # over every process
            # paged KV cache: samples preempted for want of pages this step, and the most pages in use at once
            # (against rollout.kv_pages: how close the pool ran to full)
            "kv_preemptions": sum(r.preemptions for r in reports),
            "kv_peak_pages": max((r.peak_pages for r in reports), default=0),
            "time_rollout": times.rollout, "time_reward": times.reward, "time_learn": times.learn,
            "time_sync": times.sync,
        }

    def evaluate(self, k: int | None = None, seed: int | None = None) -> dict[str, float]:
        if not self.eval_set:
            return {}
        cfg = self.cfg
        max_new = cfg.eval.max_new_tokens or cfg.rollout.global_max_len
        scorable = self.max_prompt_len + max_new <= self.learner.config.row_len  # eval samples fit a learner row
        return evaluate(self.engine, self.decode_params(), self.eval_set, self.scorer, k=k or cfg.eval.k,
                        max_new_tokens=max_new,
                        max_prompt_len=self.max_prompt_len, sampling=eval_sampling_params(cfg),
                        tokenizer=self.tokenizer, seed=cfg.trainer.seed + 1 if seed is None else seed,
                        entropy_fn=self.learner.mean_entropy if scorable else None)

    def fit(self, progress=None) -> None:
        """Train until trainer.total_steps (checkpoints as configured, and a final one)."""
        total = self.cfg.trainer.total_steps
        while self.step < total:
            metrics = self.train_step()
            if progress is not None:
                progress.update(self.step, metrics)
            if self.on_step:
                self.on_step(self.step, metrics)
        if self.cfg.checkpoint.save_every == 0 or self.step % self.cfg.checkpoint.save_every:
            self.save()
        self.checkpointer.wait()

    # -- checkpoints -------------------------------------------------------------------

    def state_meta(self) -> dict:
        """JSON run state; with several processes a collective (the rollout gathers every unfinished pool)."""
        return {"step": self.step, "process_count": self.process_count, "policy_version": self.policy_version,
                "learner_step": self.learner.step, "consecutive_skips": self.consecutive_skips,
                "consecutive_nonfinite": self.consecutive_nonfinite,
                "nonfinite_updates_total": self.nonfinite_updates_total,
                "prompts": self.prompts.state_dict(), "rollout": self.rollout.state_dict(),
                "ready_groups": [[s.to_dict() for s in g] for g in self.ready_groups]}

    def save(self) -> None:
        """Checkpoint the run state. Orbax commits a step atomically, so a failed save (disk full,
        unwritable folder) leaves the last committed checkpoint as it was; then, per
        checkpoint.on_save_error, stop with a CheckpointError or log the failure and train on."""
        try:
            # The key goes as host data: with several processes orbax refuses a host-local device array.
            self.checkpointer.save(self.step, params=self.learner.params, opt_state=self.learner.opt_state,
                                   rng=np.asarray(self.base_key), meta=self.state_meta())
            # The learner donates its arrays to the next update: let the save finish reading them.
            self.checkpointer.wait()
        except Exception as err:
            try:
                kept = self.checkpointer.latest_step()
            except Exception:  # the folder itself may be unreadable
                kept = None
            intact = (f"the last committed checkpoint (step {kept}) is intact" if kept is not None
                      else "there is no earlier committed checkpoint")
            if self.cfg.checkpoint.on_save_error == "continue":
                log.error("checkpoint at step %d failed (%s); %s; training continues "
                          "(checkpoint.on_save_error=continue)", self.step, err, intact)
                return
            raise CheckpointError(f"{err}; {intact}. The run stopped (checkpoint.on_save_error=stop): free space or "
                                  f"fix permissions, then continue with --resume") from None

    def _restore(self) -> None:
        if self.checkpointer.latest_step() is None:
            raise ValueError(f"--resume: no checkpoint in {self.checkpointer.directory}")
        params, opt_state, rng, meta = self.checkpointer.restore(params_target=self.learner.params,
                                                                 opt_state_target=self.learner.opt_state)
        saved = int(meta.get("process_count", 1))  # absent in older (one-process) checkpoints
        if saved != self.process_count:
            raise CheckpointError(f"--resume: the checkpoint of step {meta['step']} in {self.checkpointer.directory} "
                                  f"was written by {saved} process(es) but this run has {self.process_count}; each "
                                  f"process's unfinished pool resumes on its own process index, so resume with "
                                  f"--num-processes {saved}" + (" (or without the multi-process flags)" if saved == 1
                                                                else ""))
        self.learner.load_state_dict({"params": params, "opt_state": opt_state, "step": meta["learner_step"]})
        self.base_key = rng
        self.step = int(meta["step"])
        self.policy_version = int(meta["policy_version"])
        self.consecutive_skips = int(meta["consecutive_skips"])
        self.consecutive_nonfinite = int(meta.get("consecutive_nonfinite", 0))  # absent in older checkpoints
        self.nonfinite_updates_total = int(meta.get("nonfinite_updates_total", 0))
        self.prompts.load_state_dict(meta["prompts"])
        self.rollout.load_state_dict(meta["rollout"])
        self.ready_groups = [[Sample.from_dict(d) for d in g] for g in meta["ready_groups"]]
        log.info("resumed from %s at step %d", self.checkpointer.directory, self.step)

    def close(self) -> None:
        try:
            self.checkpointer.close()
        finally:  # a failed background save must not leave the writer open or reward workers running
            try:
                self.writer.close()
            finally:
                self.scorer.close()
