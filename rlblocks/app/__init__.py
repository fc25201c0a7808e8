"""The apps: the command line (``rlblocks-train``, `rlblocks.app.train`), its YAML configs
(`rlblocks.app.config_yaml`, the flag table of `rlblocks.app.cli`), the main job
(``python -m rlblocks``, `rlblocks.app.demo`) and the job a planner sizes (`rlblocks.app.job`).

They sit on top of everything: they build blocks and call recipes from a config. Nothing in
rlblocks imports them (an import-linter contract in pyproject.toml); a notebook calls the blocks
and recipes directly.
"""
