"""Typed configuration: schema (dataclasses) and loading/validation."""
from mmrl.config.load import ConfigError, load_config, to_yaml
from mmrl.config.schema import Config

__all__ = ["Config", "ConfigError", "load_config", "to_yaml"]
