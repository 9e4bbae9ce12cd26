"""The ops the forwards run: paged attention (the plain-torch reference, Triton rows and tiles), the fused
elementwise ops and their op sets (`fused_ops`), row-invariant and int8 GEMMs, the decode step's bookkeeping,
and `compile_check`, which compiles every Triton kernel of the project for a GPU target."""
