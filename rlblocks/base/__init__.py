"""The base helpers under every block, importing nothing of rlblocks but each other: the parts
of `rlblocks.rollouts` (`rollouts_table`, `rollouts_checks`, `rollouts_rows`), masked reductions
(`masked`), dispatch of a batch to devices (`dispatch`), random state (`rng`), atomic state
files (`statefile`), thread stacks (`stacks`), the run's progress as blocks read it
(`progress`), optional extras (`extras`) and the name registries of config files
(`registry`).

The contracts (`rlblocks.interfaces`) and the batch type (`rlblocks.rollouts`) stay at the
package root, where a reader starts.
"""
