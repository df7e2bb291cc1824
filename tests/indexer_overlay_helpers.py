"""What the tests of each base's overlaid indexer modules share (tests/test_indexer_overlay_vllm*.py)."""

from __future__ import annotations


class FakePlatform:
    """vLLM's current_platform as b12x_indexer's start-up checks ask it: a GPU of `capability`
    (major, minor), or no CUDA at all (None)."""

    def __init__(self, capability):
        self.capability = capability

    def is_cuda(self):
        return self.capability is not None

    def is_device_capability_family(self, family, device_id=0):
        return self.capability[0] * 10 == family

    def get_device_capability(self, device_id=0):
        from vllm.platforms.interface import DeviceCapability

        return DeviceCapability(*self.capability)
