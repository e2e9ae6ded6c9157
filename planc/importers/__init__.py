"""Importers: other tools' sharding configs translated into plan text."""
