"""Helpers for tests and demos (users' tests too): random-weight checkpoints made locally, no download."""
