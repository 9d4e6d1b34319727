/* Stand-in for Windows' icuuc.dll (the ICU that Windows 10 1703 and later carry in system32): wine 8.0 has none.
 *
 * Fills this wine gap (not a Windows one): Qt 6.11's Qt6Core.dll (PySide6-Essentials) links against the system's
 * icuuc.dll for its text converters (QStringConverter for encodings other than UTF-8/16/32 and Latin-1), so without
 * it no Qt module loads under wine. Only those ucnv_* functions are imported. Here every converter is unavailable
 * (ucnv_open fails, none are listed), which Qt handles as it does an unknown encoding; the app reads and writes
 * UTF-8 only.
 *
 * Built by scripts/windows-check.sh with Debian's MinGW (x86_64-w64-mingw32-gcc) into the check's wine prefix only;
 * never shipped.
 */
#include <stddef.h>
#include <stdint.h>

typedef int UErrorCode;  /* ICU's enum; > 0 is a failure */
typedef uint16_t UChar;
typedef int32_t UChar32;
typedef int8_t UBool;
#define U_UNSUPPORTED_ERROR 16
#define EXPORT __declspec(dllexport)

static void unsupported(UErrorCode *err) {
    if (err && *err <= 0) *err = U_UNSUPPORTED_ERROR;
}

EXPORT void *ucnv_open(const char *name, UErrorCode *err) { (void)name; unsupported(err); return NULL; }
EXPORT void ucnv_close(void *cnv) { (void)cnv; }
EXPORT void ucnv_reset(void *cnv) { (void)cnv; }
EXPORT int8_t ucnv_getMaxCharSize(const void *cnv) { (void)cnv; return 1; }
EXPORT const char *ucnv_getName(const void *cnv, UErrorCode *err) { (void)cnv; unsupported(err); return ""; }
EXPORT int32_t ucnv_countAvailable(void) { return 0; }
EXPORT const char *ucnv_getAvailableName(int32_t n) { (void)n; return NULL; }
EXPORT const char *ucnv_getStandardName(const char *name, const char *standard, UErrorCode *err) {
    (void)name; (void)standard; unsupported(err); return NULL;
}
EXPORT void ucnv_getToUCallBack(const void *cnv, void **action, const void **context) {
    (void)cnv; if (action) *action = NULL; if (context) *context = NULL;
}
EXPORT void ucnv_getFromUCallBack(const void *cnv, void **action, const void **context) {
    (void)cnv; if (action) *action = NULL; if (context) *context = NULL;
}
EXPORT void ucnv_setToUCallBack(void *cnv, void *action, const void *context, void **old_action,
                                const void **old_context, UErrorCode *err) {
    (void)cnv; (void)action; (void)context; (void)old_action; (void)old_context; unsupported(err);
}
EXPORT void ucnv_setFromUCallBack(void *cnv, void *action, const void *context, void **old_action,
                                  const void **old_context, UErrorCode *err) {
    (void)cnv; (void)action; (void)context; (void)old_action; (void)old_context; unsupported(err);
}
EXPORT void ucnv_toUnicode(void *cnv, UChar **target, const UChar *target_limit, const char **source,
                           const char *source_limit, int32_t *offsets, UBool flush, UErrorCode *err) {
    (void)cnv; (void)target; (void)target_limit; (void)source; (void)source_limit; (void)offsets; (void)flush;
    unsupported(err);
}
EXPORT void ucnv_fromUnicode(void *cnv, char **target, const char *target_limit, const UChar **source,
                             const UChar *source_limit, int32_t *offsets, UBool flush, UErrorCode *err) {
    (void)cnv; (void)target; (void)target_limit; (void)source; (void)source_limit; (void)offsets; (void)flush;
    unsupported(err);
}
EXPORT int32_t ucnv_toUCountPending(const void *cnv, UErrorCode *err) { (void)cnv; unsupported(err); return 0; }
EXPORT int32_t ucnv_fromUCountPending(const void *cnv, UErrorCode *err) { (void)cnv; unsupported(err); return 0; }
EXPORT void ucnv_cbToUWriteUChars(void *args, const UChar *source, int32_t length, int32_t offset_index,
                                  UErrorCode *err) {
    (void)args; (void)source; (void)length; (void)offset_index; unsupported(err);
}
EXPORT void ucnv_cbFromUWriteUChars(void *args, const UChar **source, const UChar *source_limit,
                                    int32_t offset_index, UErrorCode *err) {
    (void)args; (void)source; (void)source_limit; (void)offset_index; unsupported(err);
}
EXPORT void UCNV_FROM_U_CALLBACK_SUBSTITUTE(const void *context, void *args, const UChar *code_units, int32_t length,
                                            UChar32 code_point, int reason, UErrorCode *err) {
    (void)context; (void)args; (void)code_units; (void)length; (void)code_point; (void)reason; unsupported(err);
}
EXPORT void UCNV_TO_U_CALLBACK_SUBSTITUTE(const void *context, void *args, const char *code_units, int32_t length,
                                          int reason, UErrorCode *err) {
    (void)context; (void)args; (void)code_units; (void)length; (void)reason; unsupported(err);
}
