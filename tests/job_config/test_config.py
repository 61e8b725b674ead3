"""Config schema, TOML loading, command-line overrides and validation errors."""

import dataclasses
import json
import tomllib
from pathlib import Path

import pytest
import torch

from graph_trainer.errors import ConfigError, UserError
from graph_trainer.job_config.cli import build_config, help_text, load_config, parse_cli
from graph_trainer.job_config.load import CONFIGS_DIR, config_to_toml, resolve_config_path, shipped_configs, validate
from graph_trainer.job_config.memory_budget import MemoryBudget, parse_memory_budget
from graph_trainer.job_config.schema import JobConfig
from graph_trainer.runtime.device import compute_dtype, resolve_dtype

SHIPPED = [
    "deepseek_v3_16b",
    "deepseek_v3_671b",
    "deepseek_v3_debug",
    "llama3_1b",
    "llama3_405b",
    "llama3_70b",
    "llama3_8b",
    "llama3_debug",
]


def _write(tmp_path: Path, text: str, name: str = "job.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def _error(argv: list[str]) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(argv)
    message = str(info.value)
    assert "\n" not in message, "errors must be one line"
    return message


# --- shipped configs ---------------------------------------------------------


def test_shipped_configs_are_the_llama3_and_deepseek_v3_ones():
    assert shipped_configs() == SHIPPED


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_config_parses_validates_and_round_trips(name, tmp_path):
    cfg, _ = load_config(["--config", name])
    assert load_config(["--config", _write(tmp_path, config_to_toml(cfg))])[0] == cfg
    raw = tomllib.loads((CONFIGS_DIR / f"{name}.toml").read_text())
    for section, table in raw.items():
        for key, value in table.items():
            assert getattr(getattr(cfg, section), key) == value, f"{section}.{key}"


def test_shipped_configs_carry_the_published_settings():
    debug, _ = load_config(["--config", "llama3_debug"])
    assert (debug.model.flavor, debug.model.vocab_size, debug.data.tokenizer) == ("debugmodel", 258, "byte")
    assert debug.compile.mode == "trace" and not debug.checkpoint.enable
    big, _ = load_config(["--config", "llama3_8b"])
    assert (big.model.flavor, big.training.seq_len, big.training.local_batch_size) == ("8B", 8192, 1)
    assert (big.optimizer.lr, big.lr_scheduler.warmup_steps, big.training.steps) == (3e-4, 200, 1000)
    assert (big.activation_checkpoint.mode, big.activation_checkpoint.selective_ac_option) == ("selective", "op")
    huge, _ = load_config(["--config", "llama3_70b"])
    assert (huge.model.flavor, huge.optimizer.lr, huge.activation_checkpoint.mode) == ("70B", 1.5e-4, "full")
    small, _ = load_config(["--config", "llama3_1b"])
    assert (small.model.flavor, small.training.seq_len) == ("1B", 2048)


# --- defaults and precedence -------------------------------------------------


def test_defaults():
    cfg = JobConfig()
    assert cfg.training.steps == 20 and cfg.training.local_batch_size == 8 and cfg.training.seq_len == 256
    assert cfg.optimizer.lr == 8e-4 and cfg.optimizer.betas == [0.9, 0.95]
    assert cfg.activation_checkpoint.mode == "none" and cfg.activation_checkpoint.selective_ac_option == "op"
    assert cfg.compile.mode == "trace" and cfg.compile.disable_passes == []
    assert cfg.model.overrides() == {}
    # List defaults are not shared between instances.
    JobConfig().compile.disable_passes.append("x")
    assert JobConfig().compile.disable_passes == []
    loaded, opts = load_config([])
    assert loaded == cfg
    assert (opts.config, opts.print_config, opts.dry_run, opts.help) == (None, False, False, False)


def test_cli_overrides_win_over_the_file():
    cfg, _ = load_config(["--config", "llama3_debug", "--training.steps", "3", "--optimizer.lr=1e-3"])
    assert cfg.training.steps == 3 and cfg.optimizer.lr == 1e-3
    assert cfg.training.local_batch_size == 16  # from the file
    assert cfg.training.seed == 0  # from the defaults


def test_model_overrides_reach_the_model_args():
    cfg, _ = load_config(["--model.n_layers", "2", "--model.rope_theta", "10000"])
    assert cfg.model.overrides() == {"n_layers": 2, "rope_theta": 10000.0}
    assert isinstance(cfg.model.rope_theta, float)


def test_torchtitan_option_names_are_aliases_of_ours(tmp_path):
    cfg, _ = load_config(["--parallelism.data_parallel_shard_degree", "2"])
    assert cfg.parallelism.dp_shard == 2
    path = _write(tmp_path, "[parallelism]\ndata_parallel_replicate_degree = 3\n")
    cfg, _ = load_config(["--config", path])
    assert cfg.parallelism.dp_replicate == 3
    # The canonical name is the one written back.
    assert "dp_replicate = 3" in config_to_toml(cfg) and "data_parallel" not in config_to_toml(cfg)
    assert "--parallelism.data_parallel_shard_degree" in help_text()


@pytest.mark.parametrize(
    "argv",
    [
        ["--training.max_norm", "nan"],
        ["--optimizer.lr", "inf"],
        ["--optimizer.lr=-inf"],
        ["--optimizer.betas", "[0.9, nan]"],
        ["--activation_checkpoint.memory_budget", "inf"],
    ],
)
def test_every_float_option_refuses_nan_and_inf(argv):
    message = _error(argv)
    assert "must be a finite number" in message and argv[0].split("=")[0].lstrip("-") in message


@pytest.mark.parametrize(
    ("value", "fraction", "peak_bytes"),
    [("0.5", 0.5, None), ("1", 1.0, None), ("40GiB", None, 40 * 2**30), ("1.5 gib", None, 3 * 2**29),
     ("800MB", None, 800 * 10**6), ("4096B", None, 4096)],
)  # fmt: skip
def test_memory_budget_is_a_fraction_or_a_size_with_its_unit(value, fraction, peak_bytes):
    cfg, _ = load_config(["--activation_checkpoint.memory_budget", value, "--compile.trace_optimizer", "true"])
    assert parse_memory_budget(cfg.activation_checkpoint.memory_budget) == MemoryBudget(fraction, peak_bytes)


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--activation_checkpoint.memory_budget", "2"], "has no unit and is above 1"),  # once GiB of activations
        (["--activation_checkpoint.memory_budget", "40G"], "unknown unit 'G'"),  # GiB or GB?
        (["--activation_checkpoint.memory_budget", "lots"], "is not a size or a fraction"),
        (["--activation_checkpoint.memory_budget", "0"], "must be > 0"),
        (["--activation_checkpoint.memory_budget", "0GiB"], "must be > 0"),
        # A size is the whole step's peak: a compiled graph's buffers lie outside the graph it plans.
        (["--activation_checkpoint.mode", "budget", "--activation_checkpoint.memory_budget", "40GiB",
          "--compile.backend", "inductor"], "--compile.backend none"),
    ],
)  # fmt: skip
def test_a_memory_budget_that_cannot_be_read_is_refused_with_the_fix(argv, says):
    assert says in _error(argv)


def test_bool_flag_without_value_means_true():
    cfg, _ = load_config(
        [
            "--checkpoint.enable",
            "--checkpoint.resume",
            "--metrics.enable_tensorboard",
            "false",
            "--compile.dump_graphs=true",
        ]
    )
    assert cfg.checkpoint.enable is True and cfg.checkpoint.resume is True
    assert cfg.metrics.enable_tensorboard is False and cfg.compile.dump_graphs is True


def test_list_overrides():
    cfg, _ = load_config(["--compile.disable_passes", '["dce"]'])
    assert cfg.compile.disable_passes == ["dce"]
    cfg, _ = load_config(["--compile.disable_passes", "dce,cse", "--optimizer.betas", "0.8, 0.9"])
    assert cfg.compile.disable_passes == ["dce", "cse"] and cfg.optimizer.betas == [0.8, 0.9]
    cfg, _ = load_config(["--activation_checkpoint.save_list", '["aten.mm", "layers.*.attention::aten.bmm.default"]'])
    assert cfg.activation_checkpoint.save_list == ["aten.mm", "layers.*.attention::aten.bmm.default"]


def test_string_fields_keep_text_that_looks_like_toml():
    cfg, _ = load_config(
        [
            "--job.description",
            "true",
            "--job.dump_folder",
            "2024",
            "--data.source",
            "text",
            "--data.path",
            "my corpus.txt",
        ]
    )
    assert (cfg.job.description, cfg.job.dump_folder, cfg.data.path) == ("true", "2024", "my corpus.txt")
    cfg, _ = load_config(["--job.description", "-x", "--training.max_norm", "-1"])  # values starting with '-'
    assert (cfg.job.description, cfg.training.max_norm) == ("-x", -1.0)


def test_selective_ac_option_is_op_or_an_int(tmp_path):
    path = _write(tmp_path, "[activation_checkpoint]\nmode = 'selective'\nselective_ac_option = 2\n")
    cfg, _ = load_config(["--config", path])
    assert cfg.activation_checkpoint.selective_ac_option == 2
    cfg, _ = load_config(["--activation_checkpoint.selective_ac_option", "3"])
    assert cfg.activation_checkpoint.selective_ac_option == 3
    cfg, _ = load_config(["--activation_checkpoint.selective_ac_option", '"4"'])  # a digit string is an int
    assert cfg.activation_checkpoint.selective_ac_option == 4
    cfg, _ = load_config(["--activation_checkpoint.selective_ac_option", "op"])
    assert cfg.activation_checkpoint.selective_ac_option == "op"


def test_float_fields_accept_ints_but_int_fields_reject_floats_and_bools(tmp_path):
    cfg, _ = load_config(["--config", _write(tmp_path, "[optimizer]\nlr = 1\n")])
    assert cfg.optimizer.lr == 1.0 and isinstance(cfg.optimizer.lr, float)
    msg = _error(["--config", _write(tmp_path, "[training]\nsteps = true\n")])
    assert "training.steps expects an int, got True (bool)" in msg and "job.toml" in msg
    msg = _error(["--training.local_batch_size", "2.0"])
    assert "training.local_batch_size expects an int, got 2.0 (float)" in msg


# --- config names and paths ----------------------------------------------------


def test_config_names_resolve_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    expected = CONFIGS_DIR / "llama3_debug.toml"
    assert resolve_config_path("llama3_debug") == expected
    assert resolve_config_path("llama3_debug.toml") == expected
    (tmp_path / "mine.toml").write_text("[training]\nsteps = 1\n")
    assert resolve_config_path("mine.toml") == Path("mine.toml")  # an existing file is used as is
    cfg, _ = load_config(["--config", "./mine.toml"])
    assert cfg.training.steps == 1


# --- round trip ----------------------------------------------------------------


def test_config_to_toml_round_trips(tmp_path):
    cfg, _ = load_config(
        [
            "--config",
            "llama3_debug",
            "--job.description",
            'quote " backslash \\ tab \t newline \n done',
            "--model.n_layers",
            "2",
            "--model.norm_eps",
            "1e-6",
            "--model.tie_embeddings",
            "--optimizer.eps",
            "1e-12",
            "--training.max_norm",
            "-1",
            "--activation_checkpoint.selective_ac_option",
            "2",
            "--activation_checkpoint.recompute_list",
            "layers.*::aten.mul.Tensor",
            "--compile.disable_passes",
            "dce,cse",
        ]
    )
    text = config_to_toml(cfg)
    assert "n_kv_heads" not in text  # None overrides are omitted
    path = _write(tmp_path, text, "resolved.toml")
    again, _ = load_config(["--config", path])
    assert again == cfg
    assert config_to_toml(again) == text


# --- errors --------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--training.stpes", "3"], ["unknown option '--training.stpes'", "did you mean '--training.steps'"]),
        (["--training.steps", "-1"], ["training.steps must be >= 0, got -1"]),
        (["--training.steps", "ten"], ["training.steps expects an int, got 'ten' (string)"]),
        (["--training.steps"], ["--training.steps", "expected one argument"]),
        (["--training.local_batch_size", "0"], ["training.local_batch_size must be >= 1, got 0"]),
        (["--training.seq_len", "0"], ["training.seq_len must be >= 1, got 0"]),
        (["--training.seq_len", "4096"], ["training.seq_len must be <= the model's max_seq_len (2048", "got 4096"]),
        (["--optimizer.lr", "0"], ["optimizer.lr must be > 0, got 0.0"]),
        (["--optimizer.lr", "-1e-3"], ["optimizer.lr must be > 0, got -0.001"]),
        (["--optimizer.betas", "[0.9, 1.0]"], ["optimizer.betas must be < 1", "[0.9, 1.0]"]),
        (["--optimizer.betas", "[0.9]"], ["optimizer.betas must be a list of 2 floats"]),
        (["--optimizer.name", "SGD"], ["optimizer.name must be one of AdamW, got 'SGD'"]),
        (["--training.dtype", "fp16"], ["training.dtype must be one of auto|float32|bfloat16, got 'fp16'"]),
        (["--lr_scheduler.min_lr_factor", "1.5"], ["lr_scheduler.min_lr_factor must be <= 1"]),
        (["--model.flavor", "9B"], ["unknown llama3 flavor '9B'", "debugmodel", "8B"]),
        (["--model.name", "gpt9"], ["unknown model 'gpt9'", "llama3"]),
        (
            ["--activation_checkpoint.save_list", "aten.mm,torch.matmul"],
            ["activation_checkpoint.save_list[1] must look like", "got 'torch.matmul'"],
        ),
        (["--activation_checkpoint.recompute_list", "layers.*:aten.mm"], ["recompute_list[0]"]),
        (
            ["--activation_checkpoint.save_list", "aten.mm", "--activation_checkpoint.recompute_list", "aten.mm"],
            ["'aten.mm' is in both save_list and recompute_list"],
        ),
        (["--activation_checkpoint.selective_ac_option", "0"], ["selective_ac_option must be 'op' or a positive int"]),
        (["--activation_checkpoint.memory_budget", "0"], ["activation_checkpoint.memory_budget must be > 0"]),
        (["--data.source", "jsonl"], ["data.path is required for data.source = 'jsonl'"]),
        (["--data.path", "x.txt"], ["data.path 'x.txt' does not exist"]),
        (["--data.source", "embedded", "--data.path", "x.txt"], ["data.path is set", "data.source = 'embedded'"]),
        (["--checkpoint.resume"], ["checkpoint.resume = true needs checkpoint.enable = true"]),
        (["--metrics.log_freq", "0"], ["metrics.log_freq must be >= 1, got 0"]),
        (["--parallelism.dp_shard", "0"], ["parallelism.dp_shard must be >= 1, got 0"]),
        (
            ["--training.mixed_precision_param", "float16"],
            ["training.mixed_precision_param must be one of float32|bfloat16, got 'float16'"],
        ),
        # FSDP's mixed precision without FSDP is an error, not silently fp32; the fix names both ways out.
        (
            ["--training.mixed_precision_param", "bfloat16"],
            [
                "training.mixed_precision_param = 'bfloat16' is FSDP's and needs parallelism.dp_shard > 1 (got 1)",
                "--parallelism.dp_shard N",
                "--training.dtype bfloat16",
            ],
        ),
        (
            ["--training.mixed_precision_reduce", "bfloat16", "--parallelism.dp_replicate", "2"],
            ["training.mixed_precision_reduce = 'bfloat16' is FSDP's"],
        ),
        (
            [
                "--training.mixed_precision_param",
                "bfloat16",
                "--parallelism.dp_shard",
                "2",
                "--training.dtype",
                "bfloat16",
            ],
            ["training.dtype = 'bfloat16' (autocast", "drop --training.dtype"],
        ),
        (
            ["--config", "llama3_dbug"],
            [
                "config 'llama3_dbug' not found",
                "did you mean 'llama3_debug'",
                "shipped configs: " + ", ".join(SHIPPED),
            ],
        ),
        (["--config", "missing/dir.toml"], ["config file 'missing/dir.toml' not found"]),
        (["positional"], ["unexpected argument 'positional'"]),
    ],
)
def test_bad_input_raises_one_line_config_error(argv, expected):
    message = _error(argv)
    for part in expected:
        assert part in message


def test_tensor_parallelism_composes_with_accumulation_and_hugging_face_weights(tmp_path):
    """Once refused: tests/distributed/test_tp_real_runs.py trains them. The config reads only the folder's
    config.json (an empty weights file is enough here)."""
    config = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 6, "num_attention_heads": 4}
    config |= {"intermediate_size": 256, "vocab_size": 2048}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").touch()
    cfg, _ = load_config(
        ["--parallelism.tp", "2", "--training.local_batch_size", "2", "--training.global_batch_size", "8"]
        + ["--checkpoint.initial_load_path", str(tmp_path)]
    )
    assert (cfg.parallelism.tp, cfg.training.global_batch_size, cfg.model.n_layers) == (2, 8, 6)


def test_unknown_section_and_key_in_toml_suggest_the_right_name(tmp_path):
    msg = _error(["--config", _write(tmp_path, "[trainig]\nsteps = 3\n")])
    assert "unknown section '[trainig]'" in msg and "did you mean 'training'" in msg and "job.toml" in msg
    msg = _error(["--config", _write(tmp_path, "[training]\nstpes = 3\n")])
    assert "unknown key 'training.stpes' (did you mean 'training.steps'?)" in msg
    msg = _error(["--config", _write(tmp_path, "steps = 3\n")])
    assert "key 'steps' must be inside a [section] (did you mean 'training.steps'?)" in msg


def test_wrong_type_in_toml_names_file_key_and_value(tmp_path):
    msg = _error(["--config", _write(tmp_path, '[training]\nsteps = "10"\n')])
    assert msg == f"{tmp_path / 'job.toml'}: training.steps expects an int, got '10' (string)"
    msg = _error(["--config", _write(tmp_path, '[compile]\ndisable_passes = ["dce", 3]\n')])
    assert "compile.disable_passes[1] expects a string, got 3 (int)" in msg


def test_malformed_toml_reports_file_line_and_column(tmp_path):
    path = _write(tmp_path, "[training]\nsteps = 3\nseq_len = = 4\n")
    msg = _error(["--config", path])
    assert msg.startswith(f"{path}:3:") and "invalid TOML" in msg


def test_validate_checks_programmatic_configs():
    cfg = JobConfig()
    cfg.training.steps = "3"
    with pytest.raises(ConfigError, match="training.steps expects an int"):
        validate(cfg)
    cfg = JobConfig()
    cfg.compile.mode = "inductor"
    with pytest.raises(ConfigError, match=r"compile.mode must be one of trace\|eager"):
        validate(cfg)


def test_fsdp_mixed_precision_combinations_that_load():
    shard = ["--parallelism.dp_shard", "2"]
    for extra in (
        ["--training.mixed_precision_param", "bfloat16"],
        ["--training.mixed_precision_param", "bfloat16", "--training.dtype", "float32"],
        ["--training.mixed_precision_reduce", "bfloat16"],  # fp32 params, bf16 gradient reduction
        ["--training.mixed_precision_reduce", "bfloat16", "--training.dtype", "bfloat16"],
    ):
        cfg, _ = load_config([*shard, *extra])
        assert cfg.parallelism.dp_shard == 2


def test_bf16_fsdp_params_mean_no_autocast_and_bf16_compute():
    for device in (torch.device("cpu"), torch.device("cuda")):
        assert resolve_dtype("auto", device, "bfloat16") == torch.float32
        assert compute_dtype("auto", device, "bfloat16") == torch.bfloat16
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16  # unchanged without mixed precision


def test_model_options_are_the_configured_familys_own_with_their_limits_and_help():
    """[model] is generated from each family's args (models/<family>/model.py): DeepSeek-V3's expert and MLA options
    are set from the command line and TOML, listed by its --help and not by Llama's, limits checked, and an option
    of another family is refused in one line naming whose it is."""
    from models.deepseek_v3.model import ModelArgs as DeepSeekArgs
    from models.llama3.model import ModelArgs as LlamaArgs

    deepseek = help_text(family="deepseek_v3")
    assert "[model] (family deepseek_v3)" in deepseek
    for f in dataclasses.fields(DeepSeekArgs):
        assert f"--model.{f.name} " in deepseek and f.metadata["help"] in " ".join(deepseek.split())
    assert "--model.n_routed_experts" not in help_text() and "--model.n_kv_heads" not in deepseek
    assert all(f"--model.{f.name} " in help_text() for f in dataclasses.fields(LlamaArgs))
    cfg, _ = load_config(
        ["--model.name", "deepseek_v3", "--model.n_routed_experts", "16", "--model.kv_lora_rank", "32"]
    )
    assert cfg.model.overrides() == {"n_routed_experts": 16, "kv_lora_rank": 32}
    assert _error(["--model.name", "deepseek_v3", "--model.n_activated_experts", "0"]) == (
        "model.n_activated_experts must be >= 1, got 0"
    )
    assert "model.n_routed_experts is an option of deepseek_v3, not of model.name 'llama3'" in _error(
        ["--model.n_routed_experts", "16"]
    )


def test_config_error_is_a_user_error():
    assert issubclass(ConfigError, UserError)


# --- help and front-end flags ---------------------------------------------------


def test_help_lists_every_option_with_type_default_and_meaning():
    text = help_text()
    cfg = JobConfig()
    for section in dataclasses.fields(cfg):
        for f in dataclasses.fields(getattr(cfg, section.name)):
            if "llama3" not in f.metadata.get("families", ("llama3",)):
                continue  # another family's option: listed by that family's --help (below)
            assert f"--{section.name}.{f.name}" in text
            assert f.metadata["help"].split()[0] in text
    assert "--training.steps INT" in text and "(default: 20; >= 0)" in text
    assert "{none,selective,full,budget}" in text
    assert "--print-config" in text and "--dry-run" in text


def test_front_end_flags():
    opts = parse_cli(["--config", "llama3_debug", "--print-config", "--dry-run"])
    assert (opts.config, opts.print_config, opts.dry_run, opts.help) == ("llama3_debug", True, True, False)
    cfg, opts = load_config(["--help", "--training.steps", "-5"])  # help does not validate
    assert opts.help and cfg == JobConfig()
    assert build_config(parse_cli(["--training.steps", "5"])).training.steps == 5
