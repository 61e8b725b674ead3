"""docs/configuration.md is generated from the schema and stays in step with it."""

import dataclasses
from pathlib import Path

from graph_trainer.job_config.reference import COMMAND, reference
from graph_trainer.job_config.schema import section_fields, sections

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "configuration.md"


def test_configuration_page_is_the_generated_reference():
    assert PAGE.read_text() == reference(), f"docs/configuration.md is stale: run `{COMMAND}`"


def test_every_option_appears_with_its_default_and_alias():
    text = reference()
    for sec_name, sec_cls in sections().items():
        assert f"## `[{sec_name}]`" in text
        for name, f in section_fields(sec_cls).items():
            row = next(line for line in text.splitlines() if line.startswith(f"| `{name}` |"))
            assert f.metadata["help"].replace("|", "\\|") in row
            if "alias" in f.metadata:
                assert row.endswith(f"| `{f.metadata['alias']}` |")
    dp_shard = next(line for line in text.splitlines() if line.startswith("| `dp_shard` |"))
    assert "| `1` |" in dp_shard and ">= 1" in dp_shard and "`data_parallel_shard_degree`" in dp_shard
    mode = next(line for line in text.splitlines() if line.startswith("| `mode` |") and "selective" in line)
    assert "one of `none`, `selective`, `full`, `budget`" in mode


def test_model_overrides_read_unset():
    fields = section_fields(sections()["model"])
    assert fields["n_layers"].default is None and fields["n_layers"].default is not dataclasses.MISSING
    row = next(line for line in reference().splitlines() if line.startswith("| `n_layers` |"))
    assert "| `unset` |" in row
