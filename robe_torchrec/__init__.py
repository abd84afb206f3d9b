"""ROBE-Z compressed embedding tables for TorchRec."""
