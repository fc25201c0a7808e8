"""The weight side of the `RolloutEngine` contract for scripted test engines that have none."""


class Weightless:
    """Mix into a scripted engine: it holds no module, takes weight streams and ignores them,
    serves no adapter and has nothing to free. Only ``generate`` is the engine's own."""

    model = None  # no torch module: the resharder streams weights into update_weights
    serves_adapters = False
    tokenizer = None  # no tokenizer to compare with the trainer's

    def weight_spec(self) -> None:
        return None  # declares nothing: takes any stream (and ignores it)

    def update_weights(self, weights, *, version: int) -> None:
        for _ in weights:  # consume the stream like a real engine; nothing to load
            pass

    def load_adapter(self, path, *, version: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} serves no adapters")

    def sleep(self) -> None:
        pass

    def wake_up(self) -> None:
        pass
