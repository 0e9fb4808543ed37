"""Activation checkpointing: pure block policy, key-preserving mechanism, Lightning strategy hook."""
