import { Badge } from "@fluentui/react-components";
import { useT } from "../i18n/I18nContext";
import type { StatusView } from "../api/statusView";

const COLORS = { offline: "subtle", loading: "warning", working: "success" } as const;
const LABELS = { offline: "stateOffline", loading: "stateLoading", working: "stateWorking" } as const;

export function StateBadge({ state }: { state: StatusView["state"] | null }) {
  const t = useT();
  if (state === null) return <Badge color="danger" data-testid="server-state" data-state="unknown">{t("stateUnknown")}</Badge>;
  return (
    <Badge color={COLORS[state]} data-testid="server-state" data-state={state}>
      {t(LABELS[state])}
    </Badge>
  );
}
