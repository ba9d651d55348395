"""HTTP routers, one module per concern. ``ALL`` is the order they are mounted in."""

from __future__ import annotations

from fastapi import APIRouter

from routers import generate, health, info

ALL: list[APIRouter] = [generate.router, health.router, info.router]
