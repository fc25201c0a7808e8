"""``python -m rlblocks``: the main job, a small GRPO run on the built-in model and task
(`rlblocks.app.demo`; ``--help`` lists its flags)."""

from rlblocks.app.demo import main

if __name__ == "__main__":
    main()
