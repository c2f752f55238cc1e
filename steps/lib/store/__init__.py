"""The artifact store: content-addressed artifacts with manifests, aliases and lineage.

Layout under the store root (a local folder for `file://`, a bucket prefix for `s3://`):

    staging/<kind>/<id>/lease.json             who is writing this artifact now (owner, heartbeat, TTL)
    staging/<kind>/<id>/<attempt>/<files>      that writer's files and `.partial/` upload records
    artifacts/<kind>/<id>/<data files>         put in place at commit, never written to before
    artifacts/<kind>/<id>/manifest.json        created last and only if absent: no manifest, no artifact
    quarantine/<kind>/<id>/<time>/             a committed artifact that failed verification
    aliases/<name>.json                        {"kind", "id", "previous", "updated"}

Commit protocol. One writer at a time holds an artifact's lease (created only if absent; taken
over by compare-and-swap once its heartbeat is older than its TTL or its process is gone); others
wait for it, then reuse what it committed. The holder stages under its own attempt prefix; commit
moves the files into `artifacts/<kind>/<id>/` (file://: one `rename` of the attempt folder, which
fails if another writer's folder is there; s3://: server-side copies) and creates the manifest
with an exclusive create (file: `os.link`; S3: `PUT If-None-Match: *`). A writer that finds a
manifest at commit verifies it and reuses it. A killed writer's attempt is resumed by the next one.

An artifact id is derived from what produced it (kind, config section, input ids), so the same
inputs give the same id and finished work is reused. Readers verify every file's size and sha256
against the manifest before use. Promotion moves aliases; nothing is overwritten by it.

The package, one module per job, in reading order: `ids` (content addresses, hashing), `manifest`,
`backends` (file://, s3://), `writer` (leases and the commit), `store` (the `Store` class), `uri`
(`open_store`), `cache` (`LocalCache`), `maintenance` (`eaglenest store verify|gc`). Callers import from
`steps.lib.store` and use `Store` methods, never
its backend.
"""

from steps.lib.errors import ArtifactError
from steps.lib.store.backends import SINGLE_PUT_MAX_BYTES, Backend, FileBackend, S3Backend, md5_file
from steps.lib.store.cache import LocalCache
from steps.lib.store.ids import (
    ARTIFACT_ID,
    CODE_VERSION,
    ID_SCHEMA,
    SEGMENT,
    artifact_id,
    canonical_json,
    check_ref,
    code_version,
    content_sha256,
    sha256_file,
    utc_now,
)
from steps.lib.store.keys import LEASE, PARTIAL
from steps.lib.store.maintenance import collect_garbage, verify_aliases, verify_all
from steps.lib.store.manifest import MANIFEST, Manifest, is_data_file
from steps.lib.store.store import Store
from steps.lib.store.uri import default_cache_dir, open_store, store_uri_for
from steps.lib.store.writer import LEASE_TTL_S, ArtifactWriter, lease_is_dead

__all__ = [
    "ARTIFACT_ID", "CODE_VERSION", "ID_SCHEMA", "LEASE", "LEASE_TTL_S", "MANIFEST", "PARTIAL", "SEGMENT",
    "SINGLE_PUT_MAX_BYTES", "ArtifactError", "ArtifactWriter", "Backend", "FileBackend", "LocalCache", "Manifest",
    "S3Backend", "Store", "artifact_id", "canonical_json", "check_ref", "code_version", "collect_garbage",
    "content_sha256", "default_cache_dir", "is_data_file", "lease_is_dead", "md5_file", "open_store", "sha256_file",
    "store_uri_for", "utc_now", "verify_aliases", "verify_all",
]
