"""Routed experts across tiers: device slot caches, a host RAM cache, and the checkpoint on disk."""
