import { Button, Card, Text, tokens } from "@fluentui/react-components";
import { useT } from "../i18n/I18nContext";
import { statusView } from "../api/statusView";
import type { ServerStatusState } from "../useServerStatus";
import { shownState, StateBadge } from "./StateBadge";
import type { StringKey } from "../i18n/strings";

export function StatusPanel({ server }: { server: ServerStatusState }) {
  const t = useT();
  const view = server.status ? statusView(server.status, server.loadedModelId, server.measuredRate) : null;
  const rows: [StringKey, string | number | null, string][] = view
    ? [
        ["statusModel", view.model, "model"],
        ["statusBackend", view.backend, "backend"],
        ["statusStrategy", view.strategy, "strategy"],
        ["statusDevice", view.device, "device"],
        ["statusWorkers", view.workers, "workers"],
        ["statusBatch", view.batch, "batch"],
        ["statusActiveSlots", view.activeSlots, "active-slots"],
        ["statusTokensPerSecond", view.tokensPerSecond === null ? null : view.tokensPerSecond.toFixed(1), "tokens-per-second"],
      ]
    : [];
  return (
    <Card data-testid="status-panel" style={{ width: 260, flexShrink: 0 }}>
      <div style={{ display: "flex", justifyContent: "space-between", alignItems: "center" }}>
        <Text weight="semibold">{t("statusTitle")}</Text>
        <StateBadge state={shownState(view, server.error)} />
      </div>
      {server.needsPassword && (
        <div style={{ display: "flex", flexDirection: "column", gap: 6 }}>
          <Text>{t("passwordNeeded")}</Text>
          <Button size="small" onClick={server.retryPassword}>
            {t("passwordEnter")}
          </Button>
        </div>
      )}
      {server.error && (
        <Text style={{ color: tokens.colorPaletteRedForeground1, whiteSpace: "pre-wrap" }}>{server.error}</Text>
      )}
      <dl style={{ display: "grid", gridTemplateColumns: "auto 1fr", gap: "4px 12px", margin: 0 }}>
        {rows.map(([label, value, id]) => (
          <StatusRow key={id} label={t(label)} value={value ?? t("statusNone")} id={id} />
        ))}
      </dl>
    </Card>
  );
}

function StatusRow({ label, value, id }: { label: string; value: string | number; id: string }) {
  return (
    <>
      <dt style={{ color: tokens.colorNeutralForeground3 }}>{label}</dt>
      <dd style={{ margin: 0, overflowWrap: "anywhere" }} data-testid={`status-${id}`}>
        {value}
      </dd>
    </>
  );
}
