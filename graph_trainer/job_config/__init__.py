"""The job configuration: schema, values, TOML loading, the command line and resume rules.

- `schema`: one dataclass per TOML section; defaults, meanings and limits in one place.
- `values`: type coercion and range checks generated from the schema.
- `load`: config files, overrides and the checks that span fields.
- `cli`: `--section.key VALUE` options and `--help`, generated from the schema.
- `resume`: which option changes a resume honours and which it refuses.
"""
