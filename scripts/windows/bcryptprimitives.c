/* Stand-in for Windows' bcryptprimitives.dll: wine 8.0 has no such DLL.
 *
 * Fills this wine gap (not a Windows one): modules built with Rust 1.78 or later import ProcessPrng from
 * bcryptprimitives.dll for their random numbers, a DLL every Windows 10/11 has. The lock's Rust-built wheels do:
 * pydantic-core (so FastAPI and the engine's server), tokenizers, safetensors, jiter (openai, anthropic), hf-xet,
 * kernels, jsonschema-rs, grimp, ast-serialize. Under wine 8.0 their import fails with "DLL not found".
 * ProcessPrng is answered here through BCryptGenRandom, which wine's bcrypt.dll implements.
 *
 * Built by scripts/windows-check.sh with Debian's MinGW (x86_64-w64-mingw32-gcc) into the check's wine prefix only;
 * never shipped.
 */
#include <windows.h>
#include <bcrypt.h>

__declspec(dllexport) BOOL WINAPI ProcessPrng(PBYTE data, SIZE_T size)
{
    while (size > 0) {
        ULONG chunk = size > 0x40000000 ? 0x40000000 : (ULONG)size;
        if (!BCRYPT_SUCCESS(BCryptGenRandom(NULL, data, chunk, BCRYPT_USE_SYSTEM_PREFERRED_RNG)))
            return FALSE;
        data += chunk;
        size -= chunk;
    }
    return TRUE; /* Windows documents ProcessPrng as always returning TRUE */
}
