"""Weight formats shared by the engine side and the sync side: HF files, versions, buckets, checksums."""
