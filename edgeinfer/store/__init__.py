"""Model store and pull: content-addressed blobs, manifests, names, resumable downloads."""
