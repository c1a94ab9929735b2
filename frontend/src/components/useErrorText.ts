import { AuthCancelledError, describeError } from "../api/errors";
import { useT } from "../i18n/I18nContext";

/** Error text for the person: the server's own message, or a translated one for the GUI's cases. */
export function useErrorText(): (error: unknown) => string {
  const t = useT();
  return (error) => (error instanceof AuthCancelledError ? t("passwordNeeded") : describeError(error));
}
