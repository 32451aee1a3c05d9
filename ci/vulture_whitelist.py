"""Names the dead-code check (`make lint`: vulture over megarl/, bench/, docs/examples/, docs/site_pages.py) must not
report, each with why it is used although no Python call names it. A name that becomes really
unused must be deleted, not added here."""

# ruff: noqa
# fmt: off
_ = object()

# Registered by decorator and looked up by name from the config (megarl/algos/registry.py).
gae; grpo; dr_grpo; rloo; reinforce_plus_plus; reinforce_plus_plus_baseline; remax
ppo_loss; gspo_loss; agg_token_mean; agg_seq_mean_token_sum; agg_seq_mean_token_mean; agg_seq_mean_token_sum_norm
kl_k1; kl_k2; kl_k3; kl_abs
LlamaBridge; Qwen2Bridge; Qwen3Bridge; Qwen3MoeBridge  # @register_bridge, found by HF model_type
# mkdocs calls its hooks by name (mkdocs.yml's `hooks:`, docs/site_pages.py).
on_files; on_page_markdown
# The documented extension examples, named by import path in configs (docs/extending.md).
centered_score; unclipped_ratio; generate_with_prefix
# Agent loops, tools and parsers: registered by decorator, named by the data (agent_name) or a
# tool file (class_name); the agent examples by import path (docs/agents.md).
SingleTurn; ToolAgent; Calculator; PythonTool; Retrieval; parse_hermes; AnswerCheck; digit_calls; EchoUser
create_kwargs; execute_kwargs; release_kwargs  # the Tool base class's signature (verl's BaseTool)

# pydantic: validators, the model config, fields read by name (getattr) in the planner.
_._default_agent; _._loops; _._tool_parser; _._known_default; _._engine_kwargs; _._engine_kwargs_once
_._verdict_words; _._combined_components  # reward.judge / reward.combine (megarl/config/reward_sections.py)
_._range; _._combine_numbers  # reward.judge.score_range's and reward.combine's validators (pydantic calls them)
_._no_bool_for_numbers; _._known_arch; _._known_modules; _._path_or_arch; _._format_needs_distributed; _._deadline; _._strings_to_files; _._string_to_list; _._generate_function; _._estimator; _._policy_loss; _._ceiling_above_floor; _._low_below_high; _._ignored_stop_ids; _._sampling_needs_sampling
_._default_agent; _._loops; _._tool_parser; _._known_default
_._no_bool_for_numbers; _._known_arch; _._known_modules; _._path_or_arch; _._format_needs_distributed; _._deadline; _._strings_to_files; _._string_to_list; _._generate_function; _._estimator; _._policy_loss; _._ceiling_above_floor; _._low_below_high; _._ignored_stop_ids; _._sampling_needs_sampling; _._own_arguments; _._kwargs_need_template; _._top_k_samples_something; _._empty_is_unset
_._no_bool_for_numbers; _._known_arch; _._known_modules; _._path_or_arch; _._format_needs_distributed; _._deadline; _._strings_to_files; _._string_to_list; _._generate_function; _._estimator; _._policy_loss; _._ceiling_above_floor; _._low_below_high; _._ignored_stop_ids; _._sampling_needs_sampling; _._own_arguments; _._kwargs_need_template; _._one_module
model_config; vpp; cp; ep
_._ratio_or_absolute; _._verl_estimator_names  # the optimizer's ratios, verl's KL estimator names

import_problem  # called by the preflight's child process (megarl/plan/preflight.py, code as text)
class_problem  # data.custom_cls's check in the preflight's child process (likewise)
first_rows_problem  # data.custom_cls built and its first rows read there (likewise)

# Attributes and signatures Megatron, torch or transformers read or require.
_.calculate_per_token_loss; _.variable_seq_lengths; _.finalize_model_grads_func; _.grad_scale_func; _.no_sync_func; _.grad_sync_func
_.input_layernorm; _.pre_mlp_layernorm; _.core_attention; _.q_layernorm; _.k_layernorm  # layer spec fields
_.kv_layernorm; _.linear_q_down_proj; _.linear_kv_down_proj  # MLA layer spec fields (megarl/models/deepseek_v3.py)
DeepseekV3Bridge  # registered by @register_bridge("deepseek_v3")
_.extra_repr; attn_mask_type; runtime_gather_output; unused  # module interfaces Megatron calls
_.current_stream; _.wait_event; _.wait_stream; _.record_event; types; graph_safe; new_state; new_states  # cpu_compat stand-ins
_.Stream; enable_timing; blocking; interprocess; priority  # cpu_compat: torch.cuda.Stream / Event's constructors' signatures
_.pre_tokenizer; _.padding_side; _.truncation_side  # tokenizer settings
_.required  # argparse: a required subcommand
_.allow_abbrev  # argparse: no abbreviated flags (megarl/cli.py)
exc_info  # __exit__ signature
_.cu_seqlens_q_padded; _.cu_seqlens_kv_padded  # read by Megatron's rope (megarl/models/packed_rope.py)
_.get_replay_topk; _.router_replay  # megarl's per-router routing replay, called by Megatron's top-k (megarl/megatron_runtime/routing_replay.py)
sharded_offsets  # the sharded_state_dict signature Megatron calls (megarl/models/lora.py's LoRAAdapters)
_.load_peft  # LoRAAdapters: sets adapters from HF PEFT tensors (the LoRA tests; an HF adapter's safetensors)
_.__class__  # a Megatron module given megarl's subclass of its own class (megarl/models/packed_rope.py; the bench undoes it)

# Kept references and records that are read, not called.
keepalive  # tensors an IPC payload points into stay alive until the engine answered
kept_groups; dropped_groups; kept_samples; dropped_samples  # dynamic sampling's statistics (tests, logs)
emitter; meaning  # catalogue fields (docs/metrics.md's table is checked against them)
resources  # what a Ray session found at start
_.repushes; _.restarts  # the hand-over's counters of re-pushes and engine restarts
EXIT_OK; EXIT_SIGTERM  # the documented exit codes, listed together

start_standalone_engines  # wired into megarl/trainer/build.py by the asynchronous trainer
sharded_offsets  # LoRAAdapters.sharded_state_dict's signature: Megatron passes it by keyword (megarl/models/lora.py)
_.load_peft  # LoRAAdapters: sets adapters from PEFT-named tensors, the inverse of peft_tensors (tests/distributed/test_lora.py)
generated  # the generated part of a docs page (megarl/config/verl_doc.py), read by tests/unit/config/test_verl_doc.py
build_tiny_reward_model  # the tests' tiny reward model (tests/unit/rewards/test_reward_model.py, tests/e2e/test_reward_model_role.py)
# bench/vs_trl_side.py: transformers' TrainerCallback hooks, called by TRL's trainer by name.
_.on_train_begin; _.on_step_begin; _.on_step_end
calculator_calls  # the tool-use demo's parser, named by import path in configs/tiny_tool_agent.yaml
