"""Publishing the policy to the engine as one version: merged weights through the resharding
publisher, or — to an engine whose ``capabilities.lora_adapters`` is set — the LoRA adapters alone."""

from __future__ import annotations

__all__ = ["PolicyPublisher"]


class PolicyPublisher:
    """``publish(version)``: the trainer's policy as ``version`` on the engine, all-or-nothing (a
    refused publication raises ``WeightPublishError`` and the engine keeps serving the previous
    version). ``published``: what full-weight publication reads (a LoRA policy's merged view);
    ``publisher``: the :class:`~hyperrl.rollout.publisher.Publisher` into the engine's layout."""

    def __init__(self, engine, policy, published, publisher, *, adapters_only: bool, delta: bool | str = False):
        self.engine, self.policy, self.published, self.publisher = engine, policy, published, publisher
        self.adapters_only, self.delta = adapters_only, delta

    def publish(self, version: int) -> None:
        """Publish the policy as ``version`` (see the class doc)."""
        if self.adapters_only:
            self.engine.load_lora(self.policy, version)
        else:
            self.publisher.publish(self.published, version, delta=self.delta)

    def stats(self) -> dict:
        """The last publication's numbers with ``rollout.delta_publication``: ``delta_frac`` (the fraction of
        the engine's elements whose bits changed), ``publish_bytes`` against ``publish_full_bytes``."""
        last = self.publisher.last
        return {k: v for k, v in last.items() if isinstance(v, int | float)}
