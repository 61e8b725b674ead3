"""docs/configuration.md is generated from the schema and stays in step with it."""

import dataclasses
from pathlib import Path

from graph_trainer.job_config.reference import COMMAND, reference
from graph_trainer.job_config.schema import section_fields, sections

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "configuration.md"


def test_configuration_page_is_the_generated_reference():
    assert PAGE.read_text() == reference(), f"docs/configuration.md is stale: run `{COMMAND}`"


def _rows(text: str, sec_name: str) -> dict[str, str]:
    """Option name -> its table row, within one section of the page."""
    body = text.split(f"## `[{sec_name}]`\n", 1)[1].split("\n## ", 1)[0]
    return {line.split("`")[1]: line for line in body.splitlines() if line.startswith("| `")}


def test_every_option_appears_with_its_default_and_alias():
    text = reference()
    for sec_name, sec_cls in sections().items():
        rows = _rows(text, sec_name)
        assert list(rows) == list(section_fields(sec_cls))
        for name, f in section_fields(sec_cls).items():
            assert f.metadata["help"].replace("|", "\\|") in rows[name]
            if "alias" in f.metadata:
                assert rows[name].endswith(f"| `{f.metadata['alias']}` |")
    dp_shard = _rows(text, "parallelism")["dp_shard"]
    assert "| `1` |" in dp_shard and ">= 1" in dp_shard and "`data_parallel_shard_degree`" in dp_shard
    mode = _rows(text, "activation_checkpoint")["mode"]
    assert "one of `none`, `selective`, `full`, `budget`" in mode


def test_model_overrides_read_unset():
    fields = section_fields(sections()["model"])
    assert fields["n_layers"].default is None and fields["n_layers"].default is not dataclasses.MISSING
    assert "| `unset` |" in _rows(reference(), "model")["n_layers"]
