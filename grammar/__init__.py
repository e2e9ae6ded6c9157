"""The .plan grammar, shipped as package data (see plan.lark)."""
