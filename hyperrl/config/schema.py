"""The configuration schema: frozen pydantic sections, every key with its default and one line of doc.

Layers, later over earlier: the defaults below ← the recipe named by ``algo.recipe``
(:mod:`hyperrl.config.recipes`) ← a YAML file ← ``--a.b=value`` overrides (values parsed as YAML).
Types, unknown keys, dict and list values are validated by pydantic (frozen models,
``extra="forbid"``). A **variant** section names a registered factory and its arguments —
``objective: {name: gspo, clip_low: 3.0e-4}`` or just ``objective: gspo`` — and is checked
against that factory's signature at load time: the name must be registered, every argument one
the factory takes, of its type; arguments not given take the **factory's** defaults (the only
defaults). Merging a variant keeps the arguments of the layer below only while the name stays
the same, so ``--algo.objective=gspo`` gets GSPO's clips, never PPO's. Nothing is built here:
a config error names the dotted key and the fix before any model, engine or process group exists.

Pure transforms never see these objects; the trainer reads the scalars and passes them on.
"""

from __future__ import annotations

from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator, model_validator

from hyperrl.errors import HyperRLError

__all__ = ["Variant", "RewardSpec", "DataConfig", "LoraConfig", "VisionConfig", "ModelConfig", "RolloutConfig",
           "KLConfig", "CriticConfig", "AlgoConfig", "OptimConfig", "RunConfig", "AsyncConfig", "TrainConfig",
           "ConfigError"]


class ConfigError(HyperRLError, ValueError):
    """A bad config key or value; the message names the dotted key and the fix."""


class _Frozen(BaseModel):
    """Frozen, no unknown keys, no NaN or infinite number, and no boolean where a number goes
    (``--rollout.n=true`` is an error, not 1)."""

    model_config = ConfigDict(frozen=True, extra="forbid", coerce_numbers_to_str=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_a_number(cls, v, info):
        if isinstance(v, bool):
            ann = cls.model_fields[info.field_name].annotation
            args = set(get_args(ann)) if get_origin(ann) in (Union, UnionType) else {ann}
            if args & {int, float} and bool not in args:
                raise ValueError(f"expected a number, got the boolean {v}")
        return v


class Variant(_Frozen):
    """A registered factory by name and its hyperparameters (``{name: x, **args}`` or ``"x"``)."""

    name: str
    args: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _from_spec(cls, v):
        if isinstance(v, str):
            return {"name": v}
        if isinstance(v, dict) and "args" not in v:
            if "name" not in v:
                raise ValueError(f"a variant needs a 'name' (got keys {sorted(v)})")
            return {"name": v["name"], "args": {k: x for k, x in v.items() if k != "name"}}
        return v

    def spec(self) -> dict:
        return {"name": self.name, **self.args}


DType = Literal["float32", "bfloat16", "float16"]


class LoraConfig(_Frozen):
    """``model.lora``: LoRA adapters (PEFT) trained instead of every weight."""

    r: int = Field(8, ge=1, description="LoRA rank")
    alpha: int = Field(16, ge=1, description="LoRA alpha (scale alpha / r)")
    dropout: float = Field(0.0, ge=0, lt=1, description="LoRA dropout (training forwards only)")
    target_modules: list[str] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                               "up_proj", "down_proj"],
                                      description="module names that get adapters")
    train_modules: list[str] = Field(default_factory=list, description="module paths trained fully besides the "
                                     "adapters (e.g. model.norm, model.embed_tokens); saved in checkpoints too")


class VisionConfig(_Frozen):
    """``model.vision``: a vision-language policy (docs/multimodal.md) — without ``model.checkpoint``, a tiny random
    Qwen2.5-VL whose vision tower these keys size (patch 14, 2×2 merge, its language model the keys above), and the
    character tokenizer with the Qwen-VL vision tokens; its image processor resizes every image to between
    ``min_pixels`` and ``max_pixels`` (multiples of 28 a side)."""

    hidden: int = Field(32, ge=8, description="vision tower: hidden size (random init)")
    depth: int = Field(2, ge=1, description="vision tower: blocks")
    heads: int = Field(2, ge=1, description="vision tower: attention heads")
    min_pixels: int = Field(28 * 28, ge=28 * 28, description="image processor: fewest pixels after resizing (an "
                            "image of h × w pixels takes h·w / 28² placeholder tokens)")
    max_pixels: int = Field(112 * 112, ge=28 * 28, description="image processor: most pixels after resizing")
    freeze: bool = Field(False, description="train the language model only (the vision tower and its merger frozen; "
                         "with model.lora the adapters go on the language model only either way)")
    rope_theta: float = Field(1e6, gt=0, description="the tiny model's rotary base (Qwen2.5-VL's 1e6; M-RoPE gives "
                              "the image's height / width axes the lowest frequencies — with the tiny 16-dim heads "
                              "and 1e6 they turn 1e-3 … 6e-6 rad a position and neighbouring image tokens look alike: "
                              "configs/vision.yaml sets 10)")

    @model_validator(mode="after")
    def _pixels(self):
        if self.min_pixels > self.max_pixels:
            raise ValueError(f"model.vision.min_pixels={self.min_pixels} > max_pixels={self.max_pixels}")
        if self.hidden % self.heads:
            raise ValueError(f"model.vision.heads={self.heads} does not divide model.vision.hidden={self.hidden}")
        return self


class ModelConfig(_Frozen):
    """``model``: the policy — a tiny random Qwen3 sized by these keys, or a local checkpoint — its tokenizer,
    dtypes, LoRA and compile."""

    hidden: int = Field(128, description="tiny Qwen3: hidden size (random init; ignored with checkpoint)")
    layers: int = Field(2, description="tiny Qwen3: decoder layers")
    heads: int = Field(4, description="tiny Qwen3: attention heads")
    kv_heads: int = Field(2, description="tiny Qwen3: key/value heads")
    head_dim: int = Field(32, description="tiny Qwen3: head dimension")
    intermediate: int = Field(256, description="tiny Qwen3: MLP width")
    experts: int = Field(0, ge=0, description="tiny Qwen3-MoE: experts per layer (0 = the dense Qwen3; every layer "
                         "sparse otherwise)")
    experts_per_token: int = Field(2, ge=1, description="tiny Qwen3-MoE: experts routed per token (top-k)")
    moe_intermediate: int = Field(64, ge=1, description="tiny Qwen3-MoE: each expert's MLP width")
    router_aux_loss_coef: float = Field(0.001, ge=0, description="MoE: weight of the router's load-balancing loss "
                                        "(loss_router_aux; Qwen3-MoE's formula and default; 0 = off, metrics kept)")

    @model_validator(mode="after")
    def _experts(self):
        if self.experts and self.experts_per_token > self.experts:
            raise ValueError(f"model.experts_per_token={self.experts_per_token}: must be ≤ model.experts "
                             f"({self.experts})")
        return self
    checkpoint: str | None = Field(None, description="a local HF checkpoint directory instead of a random init")
    tokenizer: str | None = Field(None, description="tokenizer directory (AutoTokenizer); default: the checkpoint's "
                                  "own, or the embedded character tokenizer without a checkpoint")
    alphabet: str | None = Field(None, description="the embedded character tokenizer's characters (random init "
                                 "only; default: digits, letters and punctuation) — a task's own alphabet: a "
                                 "random-init model explores among fewer tokens (configs/code.yaml)")

    @field_validator("alphabet")
    @classmethod
    def _alphabet(cls, v):
        if v is not None:
            repeated = sorted({c for c in v if v.count(c) > 1})
            if not v or repeated:
                raise ValueError(f"model.alphabet={v!r}: needs distinct characters (repeated: {repeated})")
        return v

    @model_validator(mode="after")
    def _alphabet_without_checkpoint(self):
        if self.alphabet is not None and (self.checkpoint or self.tokenizer):
            raise ValueError("model.alphabet is the embedded character tokenizer's, for a random init; with "
                             "model.checkpoint or model.tokenizer the tokenizer is that directory's — unset one")
        return self
    chat_template: str | None = Field(None, description="the chat template (Jinja text, or a path to a .jinja file) "
                                      "replacing the tokenizer's own — what rollout, the gateway and export use "
                                      "(verl's model.custom_chat_template, TRL's chat_template_path)")

    @field_validator("chat_template")
    @classmethod
    def _template(cls, v):
        if v is None:
            return v
        from hyperrl.tokenizer import read_chat_template  # checked at load: a missing file or a Jinja error

        read_chat_template(v)
        return v
    dtype: DType = Field("float32", description="compute dtype: activations (autocast / FSDP2 param_dtype), the "
                         "rollout engine's and the reference's weights; log-probs and losses stay fp32")
    param_dtype: DType = Field("float32", description="trainable parameters and optimizer state (fp32 master "
                               "weights by default; bfloat16 halves their memory)")
    gradient_checkpointing: bool = Field(False, description="recompute decoder layers in backward (implies "
                                         "optim.shared_prefix=false: checkpointed layers drop the KV cache)")
    lm_head_fp32: bool = Field(False, description="compute the LM head (last projection; the log-softmax is fp32 "
                               "already) in fp32 while the rest runs in model.dtype — in the trainer's forwards and "
                               "the transformers engine alike (prime-rl, NeMo-RL): a bf16 head rounds logits to 8 "
                               "mantissa bits and the two sides drift apart; costs the [B, T, V] logits in fp32")
    compile: str = Field("", description="torch.compile backend for the trainer's policy forward ('' = off; "
                         "'inductor', or 'eager' / 'aot_eager' to check tracing)")
    lora: LoraConfig | None = Field(None, description="train LoRA adapters (PEFT) instead of every weight: "
                                    "{r, alpha, dropout, target_modules}; the reference is the base (no copy)")
    vision: VisionConfig | None = Field(None, description="a vision-language policy (a tiny random Qwen2.5-VL "
                                        "without model.checkpoint): {hidden, depth, heads, min_pixels, max_pixels, "
                                        "freeze, rope_theta}; images travel with the rows (docs/multimodal.md)")


class RolloutConfig(_Frozen):
    """``rollout``: the engine and what a step generates — prompts per step, samples per prompt, sampling, multi-
    turn budgets, refill rounds."""

    engine: Variant = Field(Variant(name="transformers"), description="rollout engine (hyperrl.rollout.ENGINES)")
    prompts_per_step: int = Field(32, ge=1, description="prompts (groups) per step, over all ranks (files "
                                  "tasks: 8 when unset)")
    n: int = Field(16, ge=1, description="samples per prompt (the group size; files tasks: 8 "
                   "when unset; ≥ 2 for a group-relative advantage)")
    max_new_tokens: int = Field(3, ge=1, description="response budget per turn (the arith default's answers: 2 "
                                "digits + EOS; a files task sets 512 when unset — hyperrl config lists each task's "
                                "settings)")
    temperature: float = Field(1.0, gt=0, description="sampling temperature (also divides the trainer's logits)")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling (1 = off)")
    top_k: int = Field(0, ge=0, description="top-k sampling (0 = off)")
    max_turns: int = Field(3, ge=1, description="multi-turn: turns per episode (with env)")
    max_obs_tokens: int = Field(64, ge=1, description="multi-turn: tokens per observation (text is cut to it; a "
                                "chat observation that does not fit ends the episode)")
    max_episode_tokens: int = Field(256, ge=2, description="multi-turn: tokens per episode, prompt included (the "
                                    "episode stops when they are spent)")
    max_concurrent_episodes: int = Field(64, ge=1, description="multi-turn (env): episodes running "
                                         "at once — agent programs, environments' steps (a tool's wait)")
    delta_publication: bool = Field(False, description="publish only the elements whose bits changed since the "
                                    "engine's version (indices + values per tensor, checksummed; a full publication "
                                    "when the engine holds another version) — into the transformers and vLLM engines, "
                                    "in one process, under torchrun (each planned slice's delta on the wire, TP "
                                    "included) or to Ray actors (only the deltas in the object store); metrics "
                                    "delta_frac, publish_bytes. It pays where the wire is slower than memory "
                                    "(trainer and rollout on different machines): on one machine a full "
                                    "publication is as fast (docs/rollout.md)")
    delta_encoding: Literal["sparse", "xor_zstd"] = Field("sparse", description="with delta_publication: the "
                                                          "changed elements as int32 indices + values (sparse), or the "
                                                          "xor of the bits compressed by zstd (xor_zstd: 2.6-4x fewer "
                                                          "bytes, slower to encode; needs the zstandard package) — "
                                                          "per tensor, the dense tensor when smaller")
    fan_out: bool = Field(False, description="publication across processes (torchrun) into engine replicas: the "
                          "planner's fan-out tree — the trainer's ranks send each destination shard once, the "
                          "replicas holding it forward it to the others (trainer egress one model copy; "
                          "docs/sharding.md)")
    max_generation_batches: int = Field(4, ge=1, description="with algo.filter: generation rounds per step to "
                                        "refill the batch with informative groups (verl max_num_gen_batches)")


class KLConfig(_Frozen):
    """``algo.kl``: the KL term — coefficient β, estimator, clamps and the β controller."""

    coef: float = Field(0.0, ge=0, description="β of the KL loss term (> 0 builds a reference model)")
    estimator: str = Field("k3", description="KL estimator (hyperrl.transforms.KL_ESTIMATORS; '+' suffix: "
                           "straight-through)")
    clamp_input: float | None = Field(None, description="clamp lp − ref to ±this (verl low_var_kl: 20)")
    clamp_output: float | None = Field(None, description="clamp the estimate to ±this (verl low_var_kl: 10)")
    controller: Variant = Field(Variant(name="fixed"), description="β controller (KL_CONTROLLERS: fixed | adaptive)")


class CriticConfig(_Frozen):
    """``algo.critic``: the critic (built when the advantage needs ``values``) — its lr, value clip and loss
    weight."""

    lr: float = Field(0.003, gt=0, description="critic learning rate (a critic is built when a factory needs "
                      "'values')")
    value_clip: float | None = Field(0.2, description="value clip around the rollout-time values (null = off)")
    value_coef: float = Field(1.0, ge=0, description="weight of loss_value")


class DistillConfig(_Frozen):
    """``algo.distill``: on-policy distillation — on the student's own samples, the token advantage
    ``−coef·(log π_student − log π_teacher)`` (sampled reverse KL), alone or added to the task's advantage."""

    teacher: str | None = Field(None, description="the teacher: a Hugging Face model directory with the student's "
                                "tokenizer (e.g. a run's hf/ export)")
    teachers: dict[str, str] = Field(default_factory=dict, description="multi-teacher (NeMo-RL's MOPD): data_source "
                                     "→ teacher directory; each row is distilled from its data source's teacher")
    coef: float = Field(1.0, gt=0, description="β: the distillation advantage is −β·(log π_student − log π_teacher)")
    task_coef: float = Field(0.0, ge=0, description="weight of the task reward's advantage added to it (0 = "
                             "distillation alone; the rewards are still computed and logged)")
    clip: float | None = Field(None, gt=0, description="clamp the log-ratio log π_s − log π_t to ±clip first "
                               "(null = the raw sampled reverse KL, as the peers)")
    whiten: bool = Field(False, description="centre and scale the distillation advantages over the batch's "
                         "tokens (a baseline; helps a random student far from its teacher)")
    full_vocab: bool = Field(False, description="the reverse KL over the whole next-token distribution, "
                             "KL(π_student(·|s) ‖ π_teacher(·|s)) at every action position, as a loss term "
                             "loss_distill weighted by coef (on-policy GKD, Agarwal et al. 2024) instead of the "
                             "sampled per-token advantage; the task advantage still weighs task_coef. One teacher; "
                             "not with packing or run.cp")
    jsd_beta: float = Field(1.0, ge=0, le=1, description="full_vocab only: the divergence, as TRL GKDTrainer's beta — "
                            "1 the reverse KL(student ‖ teacher) (default), 0 the forward KL(teacher ‖ student), "
                            "between them the generalized Jensen-Shannon divergence of GKD")

    @model_validator(mode="after")
    def _one_source(self):
        if (self.teacher is None) == (not self.teachers):
            raise ValueError("algo.distill: set exactly one of teacher (a directory) or teachers ({data_source: "
                             "directory})")
        return self


class AlgoConfig(_Frozen):
    """``algo``: the algorithm — a named recipe whose parts (advantage, objective, aggregation, KL, correction,
    shaping, filter) are variants overriding it."""

    recipe: str = Field("grpo_clip_higher", description="named chain (hyperrl.config.RECIPES); the keys below "
                        "override its parts")
    advantage: Variant = Field(Variant(name="grpo"), description="advantage estimator (transforms.ADVANTAGES)")
    objective: Variant = Field(Variant(name="ppo_clip"), description="policy objective (transforms.OBJECTIVES)")
    agg: Variant = Field(Variant(name="token-mean"), description="loss aggregation (transforms.AGGREGATIONS)")
    kl: KLConfig = Field(default_factory=KLConfig)
    correction: Variant | None = Field(None, description="rollout/trainer mismatch correction (transforms."
                                       "CORRECTIONS: tis | mis | rejection)")
    shaping: list[Variant] = Field(default_factory=list, description="reward shaping stages, in order "
                                   "(transforms.SHAPING: overlong | clip)")
    filter: Variant | None = Field(None, description="group filter with refill (transforms.FILTERS: "
                                   "dynamic_sampling)")
    entropy_coef: float = Field(0.0, ge=0, description="entropy bonus weight (loss_entropy = −c·agg(H))")
    loss_terms: list[Variant] = Field(default_factory=list, description="extra loss terms added to the trainer's "
                                      "loss, by name (hyperrl.algorithms.LOSS_TERMS; what they need is provided "
                                      "by hyperrl.algorithms.KEY_PROVIDERS)")
    ppo_epochs: int = Field(1, ge=1, description="passes over each rollout batch")
    gate_threshold: float | None = Field(None, description="bit-exact gate: refuse the update above this "
                                         "trainer–rollout log-prob gap")
    proximal: Literal["recompute", "interpolate"] = Field("recompute", description="the proximal policy π_prox "
                                                          "(old_logprobs: PPO's anchor, decoupled PPO's "
                                                          "π_prox/π_behav): recompute = a forward of the learner's "
                                                          "version V; interpolate = A-3PO, log π_behav + α(log π_θ "
                                                          "− log π_behav), α = (V − v_t)/(V + 1 − v_t), no forward")
    critic: CriticConfig = Field(default_factory=CriticConfig)
    distill: DistillConfig | None = Field(None, description="on-policy distillation from a teacher model "
                                          "({teacher: dir, coef: β, task_coef: w}; docs/algorithms.md)")
    preference: Variant | None = Field(None, description="train on preference pairs against a frozen reference "
                                       "(transforms.PREFERENCE_LOSSES: dpo | robust | ipo; recipes dpo, ipo): "
                                       "data.train_files of prompt / chosen / rejected rows (TRL's or verl's format) "
                                       "instead of rollouts")
    routing_replay: Literal["none", "r2", "r3"] = Field("none", description="mixture of experts (docs/moe.md): "
                                                        "r3 = every trainer forward (old, reference, update) "
                                                        "routes each token to the experts the rollout used "
                                                        "(routed_experts); r2 = the update replays the routes of "
                                                        "the trainer's own old-log-prob pass; none = the "
                                                        "router's own choice (agreement still measured)")


class OptimConfig(_Frozen):
    """``optim``: the optimizer (AdamW), lr schedule, clipping, mini- and micro-batching and the trainer's forward."""

    lr: float = Field(1e-3, gt=0, description="policy learning rate (AdamW); 1e-3 suits the tiny random model — "
                      "with model.checkpoint it is 1e-6 when unset (verl's and TRL's default)")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas")
    grad_clip: float = Field(1.0, gt=0, description="global gradient-norm clip")
    mini_batches: int = Field(1, ge=1, description="optimizer steps per rollout batch")
    micro_batch_tokens: int = Field(8192, ge=0, description="gradient-accumulation budget per micro-batch, in "
                                    "padded tokens (rows x longest row): rows grouped by length, a prompt's samples "
                                    "together, each micro-batch cut to its longest row (0 = whole mini-batch)")
    shared_prefix: bool = Field(True, description="run each distinct prompt once per forward when cheaper")
    offload: Literal["none", "cpu"] = Field("none", description="cpu: AdamW's moments and an fp32 master copy of "
                                           "the trained parameters kept and stepped in host memory "
                                           "(hyperrl.distributed.offload.HostAdamW) — three fp32 copies of the model "
                                           "off the accelerator; each step copies the gradients to the host and the "
                                           "new weights back")
    balance_rows: bool = Field(True, description="data-parallel ranks: the step's prompt groups split again before "
                               "the update so each rank does about the same work (Karmarkar-Karp over L + L²/(6·"
                               "hidden) per row; verl's balance_batch; only the rows that move are sent) — ranks "
                               "finish together; the gradient is unchanged (global token normaliser); one process: "
                               "nothing to do")
    fused_head: Literal["auto", "on", "off"] = Field(
        "auto", description="the LM head fused with the log-prob and entropy in the trainer's, reference's and "
        "teacher's forwards: no [B, T, V] logits in either pass, each chunk's logits made again in backward. on: "
        "wherever the model family allows (its logits its head's output alone: hyperrl.models.head."
        "FUSED_HEAD_FAMILIES; others run unfused); auto: so, for vocabularies of at least 8,192 tokens, where the "
        "logits outweigh the rest of the forward (a smaller one keeps the unfused path's bits); off: never")
    pack_tokens: int = Field(0, ge=0, description="padding-free trainer forwards: each micro-batch's rows packed "
                             "into sequences of at most this many tokens (position ids restart per row, no padding "
                             "computed; replaces the shared-prefix forward; under torchrun every rank makes the "
                             "most calls any rank makes); 0 = off")
    schedule: str = Field("constant", description="lr schedule (hyperrl.transforms.LR_SCHEDULES)")
    warmup_steps: int = Field(0, ge=0, description="linear warmup, in optimizer steps")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="where linear/cosine end, as a fraction of lr")


class DataConfig(_Frozen):
    """``data``: verl-style prompt files (parquet / JSONL / JSON); setting ``train_files`` makes the task
    ``files``."""

    train_files: list[str] = Field(default_factory=list, description="parquet / JSONL / JSON training prompts "
                                   "(verl columns); set = task 'files' (do not also set task)")
    val_files: list[str] = Field(default_factory=list, description="validation prompts (evaluation runs on these, "
                                 "never on training rows)")
    prompt_key: str = Field("prompt", description="the prompt column (a string or chat messages)")
    chosen_key: str = Field("chosen", description="preference pairs (algo.preference): the preferred completion's "
                            "column")
    rejected_key: str = Field("rejected", description="preference pairs (algo.preference): the other completion's "
                              "column")
    max_prompt_length: int = Field(0, ge=0, description="prompt token limit (0 = none)")
    overlong_prompts: Literal["error", "filter", "truncate"] = Field("error", description="a prompt over "
                                                                     "max_prompt_length: error | filter | truncate")
    apply_chat_template: Literal["auto", "always", "never"] = Field("auto", description="auto: chat-message "
                                                                    "prompts through the tokenizer's chat template, "
                                                                    "plain strings as is (warned once when the "
                                                                    "tokenizer has a template); always: a string is "
                                                                    "a user turn through the template; never: no "
                                                                    "template (messages as 'role: content' lines)")
    rewards: list[str] = Field(default_factory=lambda: ["gsm8k_exact"], description="the files task's registered "
                               "rewards (the top-level rewards: list overrides them)")
    image_root: str | None = Field(None, description="rows with images: a directory image paths may also lie in "
                                   "(by default only the data file's own directory; ../, absolute paths and "
                                   "symlinks leading out are refused)")


class ProfileConfig(_Frozen):
    """``run.profile``: torch.profiler over a window of steps."""

    steps: tuple[int, int] = Field(description="[first, last] step to profile (1-based, inclusive): "
                                   "out_dir/profile_steps_<first>-<last>.json, a Chrome / Perfetto trace of every "
                                   "op (CPU, and CUDA on a GPU)")

    @model_validator(mode="after")
    def _window(self):
        a, b = self.steps
        if a < 1 or b < a:
            raise ValueError(f"run.profile.steps={list(self.steps)}: give [first, last] with 1 ≤ first ≤ last "
                             "(1-based steps, inclusive), e.g. {steps: [10, 12]}")
        return self


class RunConfig(_Frozen):
    """``run``: steps, seed, evaluation, checkpoints, export, output directory, device, tensor parallelism,
    threads, logging."""

    steps: int = Field(4000, ge=0, description="training steps (files tasks: 500 when unset)")
    seed: int = Field(0, description="seed of data, sampling, init and update order")
    eval_every: int = Field(100, ge=0, description="held-out evaluation every k steps (0 = off)")
    eval_prompts: int = Field(256, ge=1, description="held-out prompts per evaluation (files tasks: 64 when unset)")
    eval_n: int = Field(1, ge=1, description="samples per held-out prompt: eval_reward_mean = mean@k, "
                        "eval_pass_at_k = mean over prompts of the best sample's reward")
    eval_greedy: bool = Field(False, description="held-out answers decoded greedily (the policy's most likely "
                              "token each step: verl's val_kwargs do_sample false) instead of sampled as in "
                              "rollout; needs eval_n 1")

    @model_validator(mode="after")
    def _greedy_once(self):
        if self.eval_greedy and self.eval_n > 1:
            raise ValueError(f"run.eval_greedy with run.eval_n={self.eval_n}: greedy answers are all the same; "
                             "set eval_n 1, or eval_greedy false to sample eval_n")
        return self
    log_completions: int = Field(0, ge=0, description="write k rows per step (prompt, completion, rewards, "
                                 "advantage) to completions.jsonl (and TensorBoard / W&B)")
    keep_last_k: int = Field(0, ge=0, description="keep only the newest k checkpoints (0 = all; files tasks: 3 "
                             "when unset)")
    export: bool = Field(True, description="at the end, save_pretrained model + tokenizer to out_dir/hf "
                         "(loads with transformers / vLLM); also `hyperrl export CKPT DIR`")
    ckpt_every: int = Field(500, ge=0, description="checkpoint every k steps and at the end (0 = only at the "
                            "end); bounds what a kill -9 can lose — SIGTERM / Ctrl-C checkpoint the finished step "
                            "anyway (the arith default: ≈ 40 s of training on 2 cores; files tasks: 50 when unset)")
    out_dir: str = Field("runs/default", description="metrics.jsonl, reward_curve.png, checkpoints/; unset: "
                         "runs/default for the embedded default, else runs/<config file's stem or task>-<hash of "
                         "the config> (rerunning a command resumes its own run, never another's)")
    device: str = Field("cpu", description="cpu | cuda | npu")
    tp: int = Field(1, ge=1, description="tensor parallelism of the trainer's policy under torchrun: groups of tp "
                    "consecutive ranks split every decoder layer (Megatron's split, hyperrl.distributed.parallelize), "
                    "FSDP2 over the world / tp data-parallel groups; 1 = FSDP2 over every rank")
    ep: int = Field(1, ge=1, description="expert parallelism of a mixture-of-experts policy under torchrun: groups "
                    "of ep consecutive ranks share each layer's experts (E/ep each; tokens dispatched by all-to-all, "
                    "hyperrl.distributed.expert_parallel), FSDP2 over every rank for the rest; 1 = off")
    cp: int = Field(1, ge=1, description="context parallelism for long sequences under torchrun: groups of cp "
                    "consecutive ranks train the same rows, each a slice of every sequence (the update's activations "
                    "and logits per rank ≈ 1/cp; attention by run.cp_attention); 1 = off")
    cp_attention: Literal["ulysses", "ring"] = Field(
        "ulysses", description="attention under run.cp > 1: ulysses — heads exchanged for sequence by all-to-all "
        "(contiguous slices; cp must divide the attention heads; hyperrl.distributed.context_parallel); ring — "
        "each rank keeps its queries, the key/value blocks pass round the cp ranks (any cp; rows cut zigzag for "
        "equal causal work; hyperrl.distributed.ring_attention)")
    threads: int = Field(0, ge=0, description="torch CPU threads (0 = torch default)")
    keep_freed_memory: bool = Field(True, description="hyperrl train / hyperrl.train: glibc's allocator keeps "
                                    "what a step frees for the next (mallopt: mmap threshold 32 MiB, trim "
                                    "threshold 1 GiB, top pad 64 MiB — far fewer page faults a step for blocks "
                                    "under 32 MiB, the same numbers bit for bit; process wide, up to ≈ 1 GiB of "
                                    "freed heap kept; skipped where MALLOC_*_ or GLIBC_TUNABLES tune malloc; "
                                    "hyperrl.allocator); false = the allocator left as it is")
    fingerprints: bool = Field(True, description="record each step's fingerprints (hashes of the prompts, samples, "
                               "log-probs, rewards, advantages, loss and weights) to fingerprints.jsonl — what "
                               "`hyperrl diff RUN_A RUN_B` compares (hyperrl.loop.fingerprints)")
    doctor_above: float | None = Field(0.01, gt=0, description="when the trainer-vs-engine mismatch (mean |Δ "
                                       "log-prob| over action tokens) exceeds this, the mismatch doctor diagnoses "
                                       "the next step's batch once and warns with its verdict (hyperrl.loop.doctor; "
                                       "a refused gate is diagnosed too); null = never")
    profile: ProfileConfig | None = Field(None, description="torch.profiler over steps [a, b]: {steps: [a, b]} → "
                                          "out_dir/profile_steps_<a>-<b>.json (opens in ui.perfetto.dev)")
    fingerprint_values: int = Field(10, ge=0, description="keep the rows themselves for the first k steps "
                                    "(fingerprints/step_<k>.safetensors): a diff there names the first differing "
                                    "token and both values")
    wandb_project: str = Field("", description="log to Weights & Biases under this project (pip install wandb)")


class RewardSpec(_Frozen):
    """One reward (see :mod:`hyperrl.rewards.styles`)."""

    fn: str | None = Field(None, description="'path/to/file.py:function' or a registered reward (hyperrl.rewards."
                           "REWARDS: a function or a factory); or set url")
    url: str | None = Field(None, description="a remote reward server (http://host:port/path) scoring batch rows per "
                            "request (hyperrl.rewards.remote: the JSON contract; style: hyperrl | openrlhf)")
    judge: dict[str, Any] | None = Field(None, description="a judge model as the reward (hyperrl.rewards.judge): "
                                         "{model: hf_dir | url: http://…/v1, template: file.jinja | text, parse: "
                                         "regex | json, pattern, key, scale, max_new_tokens, …}; an answer without "
                                         "a verdict abstains (counted)")
    weight: float = Field(1.0, description="its weight in the total reward Σ w·r (and GDPO's component weight)")
    style: str | None = Field(None, description="calling convention: trl | verl | hyperrl, or a registered "
                              "REWARD_STYLES name (required for a file's function); for a url: the server's "
                              "contract, hyperrl (default) | openrlhf (OpenRLHF's remote reward model)")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="extra keyword arguments (a factory's "
                                   "hyperparameters for registered factories)")
    name: str | None = Field(None, description="metric name (default: the function's)")
    data_source: str | list[str] | None = Field(None, description="score only samples of these data_source "
                                                "values (the rest: not applicable)")
    timeout_s: float = Field(120.0, gt=0, description="a call that has not returned after this many seconds is "
                             "stopped and reported, naming the reward — never a stalled step (inline: SIGALRM on the "
                             "main thread; pool: process: its worker killed and restarted; pool: thread: its result "
                             "dropped; async: cancelled); a TRL-style reward is called once per batch (or per chunk)")
    workers: int = Field(0, ge=0, description="calls at once: 0 = on the trainer's thread, one after another; N = a "
                         "pool of N (pool), so a batch's calls overlap each other and generation; an async def "
                         "reward runs on one event loop with at most N in flight (0: 32)")
    pool: str = Field("thread", description="where pooled calls run (workers > 0): thread — rewards that wait (a "
                      "sandbox, a server, a judge); process — CPU-bound Python (math-verify): N worker processes "
                      "started once, each rebuilding the reward; one past timeout_s is killed, one that dies is "
                      "restarted; a reward process cannot touch the trainer's memory")
    retries: int = Field(0, ge=0, description="a call that failed (raised, timed out, its worker died) is made "
                         "again up to this many times (back-off 0.1 s doubling to 2 s); counted in "
                         "reward_<name>_retries")
    on_error: Literal["raise", "abstain"] = Field("raise", description="a call still failing after its retries: "
                                                  "raise — the step fails naming the reward and the row; abstain — "
                                                  "its rows are not scored (not applicable), counted in "
                                                  "reward_<name>_failed and warned")
    batch: int | None = Field(None, ge=1, description="rows per call of a batch-style (trl) reward: null = the whole "
                              "batch inline, an equal share per worker when pooled (a reward that compares rows "
                              "across the batch must stay inline)")
    abstains: bool = Field(False, description="a TRL-style reward may return None for rows it does not score "
                           "(TRL's multi-task convention): those rows are not applicable, counted in "
                           "reward_<name>_applicable_frac; false = a None is an error naming the row")

    @model_validator(mode="before")
    @classmethod
    def _from_name(cls, v):
        return {"fn": v} if isinstance(v, str) else v

    @model_validator(mode="after")
    def _fn_url_or_judge(self):
        given = [k for k in ("fn", "url", "judge") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError("a reward needs one of fn (a file's function or a registered reward), url (a reward "
                             "server) and judge (a judge model)" + (f"; it has {' and '.join(given)}" if given else ""))
        return self


class AsyncConfig(_Frozen):
    """``async``: asynchronous RL — the staleness bound η (unset: the synchronous loop), admission, schedule, KV-
    cache policy, replay and where the rollout workers run."""

    max_staleness: int | None = Field(None, ge=0, description="η: asynchronous RL (AsyncTrainer) — a trained token "
                                      "lags the learner by at most η versions; null = the synchronous SyncTrainer "
                                      "(docs/async.md)")
    max_concurrent: int = Field(0, ge=0, description="prompt groups in flight at most (0 = (η + 1) · "
                                "rollout.prompts_per_step)")
    timeout_s: float = Field(120.0, gt=0, description="the longest the learner waits on the rollout workers "
                             "without progress (no group finished or started; a pause for publication, a call); "
                             "past it the step fails naming the worker")
    schedule: Literal["free", "gated"] = Field("free", description="free: workers run ahead within η, publications "
                                               "interrupt and resume requests; gated: batch k is generated whole at "
                                               "version max(0, k − η) — the same run every time (docs/async.md)")
    kv_cache: Literal["reprefill", "keep"] = Field("reprefill", description="what a publication does to a request "
                                                   "being generated: reprefill — interrupt it and continue from its "
                                                   "tokens under the new weights (its cache recomputed); keep — park "
                                                   "it and continue over its old KV cache (in-flight update; "
                                                   "kv_version records it per token; thread executor)")
    replay: str | None = Field(None, description="the event log (out_dir/async_events.jsonl) of a free-running run "
                               "to replay bit for bit: the same worker calls, interrupted at the same decode steps, "
                               "and the same batches")
    executor: Variant = Field(Variant(name="thread"), description="where the rollout workers run (hyperrl.rollout."
                              "EXECUTORS: thread | ray)")


class ToolSource(_Frozen):
    """One entry of ``tools:`` — the tools of an MCP server (``mcp``: its argv, started over stdio) or a
    registered tool by ``name`` (hyperrl.envs.TOOLS)."""

    mcp: list[str] | None = Field(None, description="an MCP server's command (argv list, no shell), e.g. "
                                  "[python, -m, my_server]: its tools, over stdio")
    name: str | None = Field(None, description="a registered tool (hyperrl.envs.TOOLS), e.g. calculator, python (the "
                             "sandboxed interpreter)")
    args: dict[str, Any] = Field(default_factory=dict, description="a registered tool's hyperparameters, e.g. python: "
                                 "{wall_s: 5, memory_mb: 256}")
    timeout_s: float = Field(30.0, gt=0, description="seconds per call (a call past it is a tool error)")

    @model_validator(mode="after")
    def _one(self):
        if (self.mcp is None) == (self.name is None):
            raise ValueError("a tools entry is {mcp: [command, args…]} or {name: registered_tool}")
        if self.args and self.mcp is not None:
            raise ValueError("tools[].args: hyperparameters of a registered tool (name:), not of an MCP server")
        if self.mcp is not None and not self.mcp:
            raise ValueError("tools[].mcp: the server's command (a non-empty argv list)")
        return self


class _TrainConfig(_Frozen):
    """The sections of :data:`TrainConfig` but ``async`` (a keyword: added by name below)."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    task: Variant = Field(Variant(name="arith"), description="task (hyperrl.data.tasks.TASKS)")
    data: DataConfig = Field(default_factory=DataConfig)
    env: Variant | None = Field(None, description="multi-turn environment (hyperrl.envs.ENVIRONMENTS); null = "
                                "single-turn")
    rewards: list[RewardSpec] = Field(default_factory=list, description="rewards as users write them (TRL / verl "
                                      "/ hyperrl style, weighted, routed by data_source); [] = the task's rewards")
    tools: list[ToolSource] = Field(default_factory=list, description="tools for environments that take them "
                                    "(env: {name: tool_chat}) and agent programs (solve(sample, client, tools)): "
                                    "MCP servers over stdio and registered tools")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    algo: AlgoConfig = Field(default_factory=AlgoConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    run: RunConfig = Field(default_factory=RunConfig)

    def to_dict(self) -> dict:
        return _plain(self)


# `async` is a Python keyword, so the section is declared by name (read it as getattr(cfg, "async"))
TrainConfig = create_model("TrainConfig", __base__=_TrainConfig, __module__=__name__,
                           **{"async": (AsyncConfig, Field(default_factory=AsyncConfig, description="asynchronous "
                                                           "RL: the staleness bound η and the rollout worker"))})
TrainConfig.__doc__ = ("The whole run's configuration, frozen: ``model``, ``task``, ``data``, ``env``, ``rewards``, "
                       "``rollout``, ``algo``, ``optim``, ``run`` and ``async`` (read it as "
                       "``getattr(cfg, 'async')``). Load it with :func:`hyperrl.config.load_config`, which checks "
                       "everything.")


def _plain(m):
    if isinstance(m, Variant):
        return m.spec()
    if isinstance(m, RewardSpec):
        return {k: getattr(m, k) for k in type(m).model_fields if getattr(m, k) not in (None, {})}
    if isinstance(m, BaseModel):
        return {k: _plain(getattr(m, k)) for k in type(m).model_fields}
    if isinstance(m, list | tuple):
        return [_plain(x) for x in m]
    return m


# ----------------------------------------------------------------------------- layers and merging
