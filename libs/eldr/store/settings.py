"""Settings of the persistence layer, read from `ELDR_*` environment variables.

`StoreSettings` follows the pattern of `eldr.settings` (one flat `ELDR_` namespace, one
class per concern): a service that uses the database mixes it into its settings class, e.g.
`class TrainerSettings(CommonSettings, StoreSettings)`, and configures it with
`ELDR_DATABASE_URL`.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

DEFAULT_DATABASE_URL = "sqlite:///.eldr/eldr.db"


class StoreSettings(BaseSettings):
    """Where the partition-version database is and where its migrations are."""

    model_config = SettingsConfigDict(env_prefix="ELDR_", extra="forbid", validate_default=True)

    database_url: str = Field(
        default=DEFAULT_DATABASE_URL,
        min_length=1,
        description=(
            "SQLAlchemy URL of the partition-version database: "
            "'postgresql+psycopg://user@host:5432/db' in deployment, or an SQLite file for "
            "one-machine runs (a relative path is relative to the working directory)."
        ),
    )
    migrations_dir: Path | None = Field(
        default=None,
        description=(
            "Alembic script directory; default: migrations/ of the source checkout this "
            "package runs from (it is not installed with the package)."
        ),
    )
