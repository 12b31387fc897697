"""Model helpers: tiny locally built Qwen-VL models for tests and offline demos."""
from mmrl.models.tiny_vlm import ARCHS, DEFAULT_WORDS, SPECIAL_TOKENS, build_tiny_vlm, build_tokenizer

__all__ = ["ARCHS", "DEFAULT_WORDS", "SPECIAL_TOKENS", "build_tiny_vlm", "build_tokenizer"]
