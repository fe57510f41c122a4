//! GPU MODE suite (being written)
