"""The configuration reference (docs/configuration.md), generated from the schema.

    python -m graph_trainer.job_config.reference > docs/configuration.md

Every option's default, meaning, type, limits and alias come from its `_opt(...)` declaration in
`graph_trainer.job_config.schema`, the same source as `--help` and the value checks, so the page
cannot drift from what the trainer accepts (tests/job_config/test_reference.py fails when the page
is stale). The prose around the tables is kept here, next to the code that writes them.
"""

import dataclasses
import json
import sys
from typing import Any

from graph_trainer.job_config.schema import section_fields, sections
from graph_trainer.job_config.values import limits_text, type_name, type_parts

COMMAND = "python -m graph_trainer.job_config.reference > docs/configuration.md"

INTRO = f"""\
# Configuration reference

<!-- Generated from graph_trainer/job_config/schema.py by `{COMMAND}`.
     Do not edit by hand: change the schema (or the prose in graph_trainer/job_config/reference.py)
     and run the command again; tests/job_config/test_reference.py fails while this page is stale. -->

```
python -m graph_trainer [--config NAME_OR_PATH] [--print-config] [--dry-run] [--section.key VALUE ...]
```

- `--config`: a shipped name (`llama3_debug`, `llama3_1b`, `llama3_8b`, `llama3_70b`, with or
  without `.toml`) is looked up in `configs/` (in an installed wheel: `graph_trainer/configs/`)
  from any working directory; a path is used as is.
- Precedence: defaults < TOML file < `--section.key VALUE`. VALUE is read as a TOML value when it
  parses (`3`, `1e-3`, `true`, `["dce"]`), else as a string; lists also take `a,b`; a bool option
  without a value means true (`--checkpoint.resume`).
- Mistakes print one line, `error: ...`, and exit 2 with no traceback: unknown keys get a
  did-you-mean, malformed TOML reports `file:line:col` (other exit codes: see
  [Resume, interrupts, divergence and exit codes](checkpoints.md#resume-interrupts-divergence-and-exit-codes)).
  Every float option refuses nan and inf.
- `--help` lists every option with its default; with `--config NAME` the defaults shown are that
  config's values.
- An alias is a second name for the same option (torchtitan's, where it names it differently),
  accepted in TOML files and on the command line; `--print-config` writes the canonical name.

Shipped configs: `llama3_debug` (debugmodel dims: dim 256, 6 layers, 16 heads, ffn 768, rope theta
500000, vocab 258 for the byte tokenizer), `llama3_1b`, `llama3_8b` (seq 8192, AdamW lr 3e-4,
betas 0.9/0.95, wd 0.1, warmup 200, max_norm 1.0, selective AC), `llama3_70b`. The big configs
use the byte tokenizer so they run as shipped; point `data.tokenizer` at a Llama-3
`tokenizer.json` for real training. Parameter counts (printed at start-up): debugmodel 6,163,712
(5,247,232 with the byte vocab), 1B 1,235,814,400, 8B 8,030,261,248, 70B 70,553,706,496.
`model.flavor` names one of the model family's flavors (Llama-3: debugmodel, 1B, 8B, 70B); the
`[model]` options left unset keep the flavor's values.
`[model]` holds every family's arguments, declared next to them in `models/<family>/model.py`; each row says
whose they are, `--help` lists the configured family's (`--model.name deepseek_v3 --help`), and an option of
another family is refused in one line. With `checkpoint.initial_load_path` a Hugging Face folder's `config.json`
sets the family and every one of its options (docs/hf_weights.md).
"""


def _value_text(value: Any) -> str:
    """A default as it would be written in a TOML file (unset for the model overrides' None)."""
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(_value_text(v) for v in value) + "]"
    if isinstance(value, str):
        return json.dumps(value)
    return repr(value)


def _limits(f: dataclasses.Field) -> str:
    """Type, allowed values and bounds of one option, in words."""
    types = " or ".join(type_name(tp) for tp in type_parts(f.type))
    parts = [types]
    if "choices" in f.metadata:
        parts.append("one of " + ", ".join(f"`{c}`" for c in f.metadata["choices"]))
    bounds = limits_text(f.metadata)
    if bounds:
        each = " (each element)" if types.startswith("list") else ""
        parts.append(bounds + each)
    return "; ".join(parts)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def section_table(sec_name: str, sec_cls: type) -> str:
    """One section's options as a Markdown table: option, default, meaning, limits, alias."""
    rows = [
        f"## `[{sec_name}]`",
        "",
        "| option | default | meaning | type and limits | alias |",
        "|---|---|---|---|---|",
    ]
    for name, f in section_fields(sec_cls).items():
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        alias = f"`{f.metadata['alias']}`" if "alias" in f.metadata else ""
        meaning = f.metadata["help"]
        if "families" in f.metadata:  # a model family's argument: whose
            meaning += f" ({', '.join(f.metadata['families'])})"
        cells = [f"`{name}`", f"`{_value_text(default)}`", _cell(meaning), _cell(_limits(f)), alias]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"


def reference() -> str:
    """The whole configuration reference page, one table per section in the schema's order."""
    tables = [section_table(name, cls) for name, cls in sections().items()]
    return INTRO + "\n" + "\n".join(tables)


def main() -> None:
    sys.stdout.write(reference())


if __name__ == "__main__":
    main()
