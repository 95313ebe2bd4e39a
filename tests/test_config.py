"""Run configuration: shipped YAMLs, overrides, error messages, cross-field rules, a loader property test."""

from __future__ import annotations

import dataclasses
import math
import re

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ulorl_jax.config import (
    CHOICES,
    SCHEMA,
    ConfigError,
    RunConfig,
    config_to_dict,
    config_to_yaml,
    load_config,
    shipped_configs,
)
from ulorl_jax.models.config import ModelConfig

SHIPPED = ["tiny_cpu", "qwen3_4b", "qwen3_8b", "qwen3_30b_a3b_128k", "qwen3_30b_a3b_128k_yarn"]


def test_every_expected_config_is_shipped():
    assert set(SHIPPED) <= set(shipped_configs())


@pytest.mark.parametrize("name", shipped_configs())
def test_shipped_config_loads_and_round_trips(name, tmp_path):
    cfg = load_config(name)
    assert isinstance(cfg, RunConfig)
    assert cfg.rollout.global_max_len % cfg.rollout.num_segments == 0
    cfg.model.model_config()  # the architecture (fresh, or the one a checkpoint must have) is valid
    path = tmp_path / "config.yaml"
    path.write_text(config_to_yaml(cfg))
    assert load_config(str(path)) == cfg  # what the trainer saves loads back identically


@pytest.mark.parametrize("name", ["qwen3_30b_a3b_128k", "qwen3_30b_a3b_128k_yarn"])
def test_paper_recipe_values(name):
    """ULORL.md "Rest of the recipe": the full-scale configs carry the paper's hyperparameters."""
    cfg = load_config(name)
    assert (cfg.optim.lr, cfg.optim.warmup_steps) == (1e-6, 0)
    assert (cfg.trainer.train_batch_size, cfg.rollout.n, cfg.trainer.ppo_mini_batch_size) == (128, 8, 1024)
    assert (cfg.rollout.temperature, cfg.rollout.top_p, cfg.rollout.top_k) == (0.85, 1.0, 0)
    assert (cfg.rollout.global_max_len, cfg.rollout.num_segments, cfg.rollout.segment_len) == (131072, 8, 16384)
    assert (cfg.algorithm.tau, cfg.algorithm.sigma, cfg.algorithm.mask_mode, cfg.algorithm.is_mode) == (
        0.99, 0.2, "dmmpt", "pois")
    assert (cfg.eval.k, cfg.eval.temperature, cfg.eval.top_k, cfg.eval.top_p) == (32, 0.85, 20, 0.95)


def test_yarn_config_scales_rope_by_1_5():
    plain, yarn = load_config("qwen3_30b_a3b_128k"), load_config("qwen3_30b_a3b_128k_yarn")
    assert plain.model.model_config().rope_scaling is None
    scaling = yarn.model.model_config().rope_scaling
    assert scaling["rope_type"] == "yarn" and scaling["factor"] == 1.5


def _param_count(model_config: ModelConfig) -> int:
    """Parameters of the full-size model, from shapes only (jax.eval_shape: nothing allocated)."""
    import jax
    from flax import nnx

    from ulorl_jax.models.qwen3 import Qwen3ForCausalLM

    abstract = nnx.eval_shape(lambda: Qwen3ForCausalLM(model_config, rngs=nnx.Rngs(0)))
    return sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))


@pytest.mark.parametrize("name, published", [
    ("qwen3_4b", 4.02e9),  # Qwen3-4B model card: 4.0B parameters
    ("qwen3_8b", 8.19e9),  # Qwen3-8B model card: 8.2B
    pytest.param("qwen3_30b_a3b_128k", 30.5e9, marks=pytest.mark.slow),  # Qwen3-30B-A3B model card: 30.5B total
])
def test_full_size_arch_matches_published_parameter_count(name, published):
    count = _param_count(load_config(name).model.model_config())
    assert abs(count - published) / published < 0.01, f"{name}: {count:,} parameters"


# --- errors ---------------------------------------------------------------------------------


def test_unknown_yaml_key_names_full_path_and_closest(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model: {arch: {model_type: qwen3}}\ndata: {synthetic: {}}\nalgorithm:\n  sigmma: 0.3\n")
    with pytest.raises(ConfigError, match=r"'algorithm\.sigmma'.*bad\.yaml.*closest valid key is 'algorithm\.sigma'"):
        load_config(str(path))


def test_wrong_container_in_yaml_names_the_key(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("trainer: {seed: 3}\ndata: {chat_template_kwargs: [1], train_files: [a.jsonl]}\n")
    with pytest.raises(ConfigError, match=r"data\.chat_template_kwargs=\[1\] \(in .*bad\.yaml\): expected dict"):
        load_config(str(path))


def test_unknown_section_in_yaml(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("rolout: {n: 4}\n")
    with pytest.raises(ConfigError, match=r"'rolout'.*closest valid key is 'rollout"):
        load_config(str(path))


@pytest.mark.parametrize("override, closest", [
    ("algorithm.tua=0.5", "algorithm.tau"),
    ("trainer.lr=0.1", "optim.lr"),  # right name, wrong section
    ("rollout.num_segment=4", "rollout.num_segments"),
    ("model.arch.hidden_sise=32", "model.arch.hidden_size"),
    ("checkpoint.keep=2", "checkpoint.keep_last"),
])
def test_unknown_override_names_closest_key(override, closest):
    with pytest.raises(ConfigError, match=rf"'{override.split('=')[0]}'.*closest valid key is '{closest}'"):
        load_config("tiny_cpu", [override])


@pytest.mark.parametrize("override, pattern", [
    ("algorithm.tau=abc", r"algorithm\.tau='abc'.*expected float"),
    ("rollout.n=2.5", r"rollout\.n='2\.5'.*expected int"),
    ("logging.wandb=maybe", r"logging\.wandb='maybe'.*expected bool"),
    ("optim.betas=[0.9]", r"optim\.betas=.*expected tuple\[float, float\]"),
    ("eval.k=null", r"eval\.k='null'.*expected int"),
    # a list where a mapping goes and the reverse (OmegaConf >= 2.4 raises a bare TypeError for these)
    ("data.chat_template_kwargs=[]", r"data\.chat_template_kwargs='\[\]'.*expected dict"),
    ("data.train_files={a: 1}", r"data\.train_files=.*expected list\[str\]"),
    ("rollout.prefill_buckets={a: 1}", r"rollout\.prefill_buckets=.*expected list\[int\]"),
])
def test_wrong_type_names_key_value_and_expected(override, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_config("tiny_cpu", [override])


@pytest.mark.parametrize("overrides, pattern", [
    (["algorithm.tau=0"], r"algorithm\.tau=0\.0: expected a probability in \(0, 1\]"),
    (["algorithm.tau=1.01"], r"algorithm\.tau"),
    (["algorithm.sigma=0"], r"algorithm\.sigma=0\.0: expected a target entropy > 0"),
    (["rollout.num_segments=5"], r"rollout\.num_segments=5: expected a divisor of rollout\.global_max_len=96"),
    (["rollout.num_segments=0"], r"rollout\.num_segments=0"),
    (["algorithm.clip_ratio_low=-0.1"], r"algorithm\.clip_ratio_low"),
    (["algorithm.clip_ratio_high=-1"], r"algorithm\.clip_ratio_high"),
    (["optim.lr=0"], r"optim\.lr=0\.0: expected > 0"),
    (["rollout.n=1"], r"rollout\.n=1: expected >= 2.*GRPO"),
    (["trainer.train_batch_size=8", "trainer.ppo_mini_batch_size=48"], r"ppo_mini_batch_size=48.*8 \* 8 = 64"),
    (["mesh.data=-1"], r"at most one axis set to -1"),
    (["mesh.tensor=0"], r"mesh\.tensor=0"),
    (["mesh.expert=-2"], r"mesh\.expert=-2"),
    (["algorithm.is_mode=tois"], r"algorithm\.is_mode='tois': expected one of \['pois', 'sais'\]"),
    (["algorithm.mask_mode=dmpt"], r"did you mean 'dmmpt'"),
    (["algorithm.entropy_mode=token"], r"algorithm\.entropy_mode"),
    (["algorithm.loss_agg_mode=seq-mean"], r"algorithm\.loss_agg_mode"),
    (["rollout.backend=vllm"], r"rollout\.backend='vllm'"),
    (["rollout.preemption=swapped"], r"rollout\.preemption='swapped': expected one of \['recompute', 'swap'\]"),
    (["model.attention_impl=flash"], r"model\.attention_impl='flash'"),
    (["model.moe_impl=sparse"], r"model\.moe_impl"),
    (["reward.kind=llm"], r"reward\.kind='llm'"),
    (["reward.kind=custom"], r"reward\.custom_fn"),
    (["reward.kind=verifier"], r"reward\.verifier_model"),
    (["reward.answer_pattern=(unclosed"], r"reward\.answer_pattern.*not a valid regex"),
    (["model.arch.num_experts_per_tok=9"], r"model\.arch: num_experts_per_tok=9"),
    (["model.arch.dtype=bfloat16"], r"model\.arch\.dtype: set model\.dtype instead"),
    (["model.arch=null"], r"model\.path and model\.arch are both null"),
    (["model.arch={model_type: qwen3, hidden_sise: 8}"], r"closest valid key is 'model\.arch\.hidden_size'"),
    (["model.overrides.rope_scalin=null"], r"closest valid key is 'model\.overrides\.rope_scaling'"),
    (["data.synthetic=null"], r"data\.train_files is empty and data\.synthetic is null"),
    (["trainer.row_len=64"], r"trainer\.row_len=64.*= 160"),
    (["rollout.prefill_buckets=[16,8]"], r"rollout\.prefill_buckets"),
    (["rollout.top_p=0"], r"rollout\.top_p"),
    (["checkpoint.keep_last=0"], r"checkpoint\.keep_last"),
    (["algorithm=3"], r"'algorithm' is a section"),
    (["algorithm.tau"], r"not of the form key=value"),
    (["optim.lr=${nowhere}"], r"optim\.lr"),
    (["optim.lr=1e400"], r"optim\.lr=inf: expected a finite number"),
    (["algorithm.entropy_coeff=nan"], r"algorithm\.entropy_coeff=nan: expected a finite number"),
    (["rollout.n=\x1f"], r"rollout\.n"),
])
def test_invalid_values_are_named(overrides, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_config("tiny_cpu", overrides)


def test_missing_config_file_lists_shipped():
    with pytest.raises(ConfigError, match=r"'no_such_config' not found.*tiny_cpu"):
        load_config("no_such_config")


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)  # the CLI prints ValueErrors plainly


# --- behaviour ------------------------------------------------------------------------------


def test_overrides_apply_in_order_and_reach_nested_dicts():
    cfg = load_config("tiny_cpu", ["algorithm.sigma=0.3", "algorithm.sigma=0.5", "model.arch.hidden_size=32",
                                   "data.synthetic.num_train=7", "rollout.prefill_buckets=[8,16]",
                                   "optim.betas=[0.8,0.95]", "data.train_files=[a.jsonl,b.parquet]"])
    assert cfg.algorithm.sigma == 0.5
    assert cfg.model.model_config().hidden_size == 32
    assert cfg.data.synthetic["num_train"] == 7
    assert cfg.rollout.prefill_buckets == [8, 16]
    assert tuple(cfg.optim.betas) == (0.8, 0.95)
    assert cfg.data.train_files == ["a.jsonl", "b.parquet"]


def _tiny_yaml_with(path, chat_template_kwargs: str):
    """tiny_cpu as a file, with `chat_template_kwargs: <the text given>` in its data section."""
    text = config_to_yaml(load_config("tiny_cpu")).replace("  chat_template_kwargs: {}\n", "")
    path.write_text(text.replace("data:\n", f"data:\n  chat_template_kwargs: {chat_template_kwargs}\n", 1))
    return path


def test_dotted_overrides_reach_every_free_form_mapping(tmp_path):
    path = _tiny_yaml_with(tmp_path / "c.yaml", "{enable_thinking: false, mode: a}")
    cfg = load_config(str(path), ["data.chat_template_kwargs.enable_thinking=true", "data.synthetic.num_train=9",
                                  "data.chat_template_kwargs.nested.depth=2"])
    assert cfg.data.chat_template_kwargs == {"enable_thinking": True, "mode": "a", "nested": {"depth": 2}}
    assert cfg.data.synthetic["num_train"] == 9
    cfg = load_config("tiny_cpu", ["data.chat_template_kwargs={enable_thinking: true}"])  # the whole mapping
    assert cfg.data.chat_template_kwargs == {"enable_thinking": True}
    with pytest.raises(ConfigError, match=r"closest valid key is 'model\.arch\.hidden_size'"):  # still checked
        load_config("tiny_cpu", ["model.arch.hidden_sise=8"])


@pytest.mark.parametrize("override, fix", [
    ("data.chat_template_kwargs={enable_thinking:true}",
     "data.chat_template_kwargs={enable_thinking: true}, or data.chat_template_kwargs.enable_thinking=true"),
    ("data.chat_template_kwargs={a: 1, b:2}", "data.chat_template_kwargs={b: 2}, or data.chat_template_kwargs.b=2"),
    ("model.overrides={rope_scaling:null}", "model.overrides={rope_scaling: null}"),
])
def test_a_flow_mapping_without_a_space_after_the_colon_is_refused_with_the_right_form(override, fix):
    # YAML reads {enable_thinking:true} as the key 'enable_thinking:true' with no value, which no option means
    with pytest.raises(ConfigError, match=r"the entry '.*:.*' has no value.*Write " + re.escape(fix)):
        load_config("tiny_cpu", [override])


def test_a_yaml_file_with_a_colon_key_is_refused_too(tmp_path):
    path = _tiny_yaml_with(tmp_path / "c.yaml", "{enable_thinking:true}")
    with pytest.raises(ConfigError, match=r"data\.chat_template_kwargs \(in .*c\.yaml\): the entry "
                                          r"'enable_thinking:true' has no value.*chat_template_kwargs: "
                                          r"\{enable_thinking: true\}"):
        load_config(str(path))
    path = _tiny_yaml_with(tmp_path / "c.yaml", '{"a:b": 1}')  # a quoted key with a value is a real key
    assert load_config(str(path)).data.chat_template_kwargs == {"a:b": 1}


def test_model_config_checks_checkpoint_against_arch_and_applies_overrides():
    cfg = load_config("qwen3_30b_a3b_128k_yarn", ["model.dtype=bfloat16"])
    checkpoint = cfg.model.model_config().replace(rope_scaling=None, dtype="float32")  # as config.json reads
    built = cfg.model.model_config(checkpoint)
    assert built.rope_scaling["factor"] == 1.5 and built.dtype == "bfloat16"
    wrong = checkpoint.replace(num_hidden_layers=24)
    with pytest.raises(ConfigError, match=r"model\.arch\.num_hidden_layers=48 but the checkpoint .* has 24"):
        cfg.model.model_config(wrong)


def test_mesh_section_builds_a_mesh_config():
    from ulorl_jax.sharding import MeshConfig

    mesh = load_config("qwen3_30b_a3b_128k").mesh.mesh_config()
    assert mesh == MeshConfig(data=1, fsdp=-1, expert=2, context=4, tensor=1)
    assert mesh.shape(16) == {"data": 1, "fsdp": 2, "expert": 2, "context": 4, "tensor": 1}


def test_config_to_dict_is_plain():
    d = config_to_dict(load_config("tiny_cpu"))
    assert d["optim"]["betas"] == [0.9, 0.999] and d["model"]["arch"]["hidden_size"] == 64
    assert set(d) == {f.name for f in dataclasses.fields(RunConfig)}


# --- property test over the loader ----------------------------------------------------------

_floats = st.floats(allow_nan=False, allow_infinity=False, width=64)
# Keys with a generator of values that are valid on top of tiny_cpu.
VALID = {
    "algorithm.tau": st.floats(min_value=1e-6, max_value=1.0),
    "algorithm.sigma": st.floats(min_value=1e-6, max_value=10.0),
    "algorithm.clip_ratio_low": st.floats(min_value=0.0, max_value=1.0, exclude_max=True),
    "algorithm.clip_ratio_high": st.floats(min_value=0.0, max_value=1.0),
    "algorithm.entropy_coeff": st.floats(min_value=-1.0, max_value=1.0),
    "algorithm.norm_adv_by_std": st.booleans(),
    "algorithm.dynamic_sampling": st.booleans(),
    "optim.lr": st.floats(min_value=1e-9, max_value=1.0),
    "optim.weight_decay": st.floats(min_value=0.0, max_value=1.0),
    "optim.warmup_steps": st.integers(0, 10_000),
    "rollout.temperature": st.floats(min_value=0.0, max_value=5.0),
    "rollout.top_p": st.floats(min_value=1e-6, max_value=1.0),
    "rollout.top_k": st.integers(0, 1000),
    "rollout.num_segments": st.sampled_from([1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 96]),  # divisors of 96
    "trainer.seed": st.integers(0, 2**31 - 1),
    "trainer.total_steps": st.integers(0, 10**6),
    "eval.k": st.integers(1, 1024),
    "checkpoint.keep_last": st.integers(1, 100),
    # a bare word YAML reads as a bool or null (false, yes, off, null, ...) is not a valid project name
    "logging.wandb_project": st.text(alphabet="abcdefghijklmnopqrstuvwxyz_-", min_size=1, max_size=12).filter(
        lambda w: w not in {"true", "false", "yes", "no", "on", "off", "y", "n", "null"}),
    # reward.kind=verifier/custom need a second key (tested above).
    **{key: st.sampled_from(allowed) for key, allowed in CHOICES.items() if key != "reward.kind"},
}


def _literal(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if isinstance(value, float) else str(value)


def _get(cfg, key):
    obj = cfg
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_property_valid_overrides_are_reflected(data):
    keys = data.draw(st.lists(st.sampled_from(sorted(VALID)), min_size=1, max_size=4, unique=True))
    values = {k: data.draw(VALID[k], label=k) for k in keys}
    cfg = load_config("tiny_cpu", [f"{k}={_literal(v)}" for k, v in values.items()])
    for key, value in values.items():
        assert _get(cfg, key) == value, key


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    key=st.one_of(st.sampled_from(sorted(SCHEMA)), st.text(max_size=20),
                  st.sampled_from(sorted(SCHEMA)).map(lambda k: k + "x"), st.just("model.arch.hidden_size")),
    value=st.one_of(st.text(max_size=12), _floats.map(repr), st.integers(-5, 10**6).map(str),
                    st.sampled_from(["null", "true", "[1, 2]", "{a: 1}", "${x}", "", "-1", "nan", "1e400"])),
)
def test_property_any_override_is_accepted_or_config_error(key, value):
    try:
        cfg = load_config("tiny_cpu", [f"{key}={value}"])
    except ConfigError:
        return
    assert isinstance(cfg, RunConfig)


@pytest.mark.parametrize("value, policy", [("dots", "dots"), ("dots_saveable", "dots_saveable"), ("none", "none"),
                                           ("full", "full"), ("attention", "attention"), ("true", "full"),
                                           ("false", "none")])
def test_every_remat_policy_reaches_the_learner_from_yaml(value, policy):
    from ulorl_jax.rl.build import learner_config
    from ulorl_jax.rl.learner import REMAT_POLICIES

    cfg = load_config("tiny_cpu", [f"trainer.remat={value}"])
    assert cfg.trainer.remat == policy  # older configs' booleans become the policy name at load
    assert learner_config(cfg).remat == policy and policy in REMAT_POLICIES


@pytest.mark.parametrize("saved, now, ok", [(True, "full", True), (False, "none", True), (True, "dots", False)])
def test_a_run_folder_with_an_older_boolean_remat_still_resumes(tmp_path, saved, now, ok):
    """A run folder's config.yaml written when trainer.remat was true / false resumes under the policy it
    meant, and a real change of policy is still refused."""
    from ulorl_jax.config import config_to_dict
    from ulorl_jax.rl.trainer import check_resume_config

    old = config_to_dict(load_config("tiny_cpu"))
    old["trainer"]["remat"] = saved
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(old))
    cfg = load_config(str(path), [f"trainer.remat={now}"])
    if ok:
        check_resume_config(path, cfg)
    else:
        with pytest.raises(ValueError, match=r"trainer.remat: 'full' -> 'dots'"):
            check_resume_config(path, cfg)


def test_bad_remat_names_the_key_and_the_policies():
    with pytest.raises(ConfigError, match=r"trainer.remat='dot': expected one of \['none', 'full', 'dots'"):
        load_config("tiny_cpu", ["trainer.remat=dot"])


def test_rollout_engine_reward_and_sampling_take_their_options_by_name():
    """rl/build's same_named: every option of the part's YAML section arrives in its config (non-default
    values, so a field left at its default fails), and a derived field names its source."""
    from ulorl_jax.model_source import build_tokenizer
    from ulorl_jax.rewards.scorer import RewardConfig
    from ulorl_jax.rl.build import (
        build_engine,
        build_model,
        eval_sampling_params,
        rollout_config,
        same_named,
        sampling_params,
    )
    from ulorl_jax.sharding import MeshConfig

    cfg = load_config("tiny_cpu", ["rollout.global_max_len=96", "rollout.num_segments=3", "rollout.n=5", "trainer.ppo_mini_batch_size=40",
                                   "rollout.temperature=0.7", "rollout.top_k=11", "rollout.top_p=0.9",
                                   "rollout.prefill_buckets=[16,64,136]", "rollout.prefill_token_budget=640",
                                   "rollout.page_size=8", "rollout.kv_pages=50", "rollout.preemption=swap",
                                   "eval.temperature=0.6", "eval.top_k=7", "eval.top_p=0.8",
                                   "reward.timeout_s=2.5", "reward.workers=0", "reward.extraction=math_verify",
                                   "reward.answer_pattern=ans=(\\d+)", "mesh.data=2", "mesh.fsdp=1"])
    tokenizer = build_tokenizer(cfg)
    model = build_model(cfg, tokenizer, seed=0)
    rc = rollout_config(cfg, model, tokenizer, max_prompt_len=40)
    assert (rc.global_max_len, rc.num_segments, rc.samples_per_prompt, rc.max_prompt_len) == (96, 3, 5, 40)
    assert (rc.sampling.temperature, rc.sampling.top_k, rc.sampling.top_p) == (0.7, 11, 0.9)
    assert rc.eos_token_ids == (tokenizer.eos_token_id,)
    assert sampling_params(cfg) == rc.sampling
    e = eval_sampling_params(cfg)
    assert (e.temperature, e.top_k, e.top_p) == (0.6, 7, 0.8)
    reward = same_named(RewardConfig, cfg.reward)
    assert dataclasses.asdict(reward) == {f.name: getattr(cfg.reward, f.name)
                                          for f in dataclasses.fields(RewardConfig)}
    assert (reward.timeout_s, reward.workers, reward.extraction, reward.answer_pattern) == \
        (2.5, 0, "math_verify", "ans=(\\d+)")
    assert same_named(MeshConfig, cfg.mesh) == MeshConfig(data=2, fsdp=1, expert=1, tensor=1)
    engine = build_engine(cfg, model, tokenizer, slots=3, max_len=136,
                          sampling=rc.sampling)
    assert (engine.max_concurrent_decodes, engine.max_cache_len) == (3, 136)
    assert engine.prefill_buckets == (16, 64, 136)
    assert engine.prefill_token_budget == 640
    assert (engine.kv_cache, engine.page_size, engine.num_pages, engine.preemption) == ("paged", 8, 50, "swap")
    assert engine.sampling == rc.sampling and engine.eos_token_ids == rc.eos_token_ids


def test_run_eos_ids_are_the_model_configs_and_the_tokenizers():
    """The trainer and `ulorl eval` end samples at the same ids as `ulorl generate` / `serve`: the model
    config's eos_token_id (int or list) and the tokenizer's; neither having one is an error."""
    import types

    from ulorl_jax.rl.build import eos_ids

    tok = types.SimpleNamespace(eos_token_id=5)
    assert eos_ids(ModelConfig(eos_token_id=[9, 7]), tok) == (5, 7, 9)
    assert eos_ids(ModelConfig(eos_token_id=5), tok) == (5,)
    assert eos_ids(ModelConfig(), tok) == (5,)
    with pytest.raises(ValueError, match="neither the tokenizer nor the model config has an eos_token_id"):
        eos_ids(ModelConfig(), types.SimpleNamespace(eos_token_id=None))
